"""The architecture facts our decoder needs, read once from a Hugging Face config."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# The Hugging Face architectures we serve, by their config's model_type (README.md's table of
# architectures lists exactly these: tests/test_readme_architectures.py).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3_text",
    "GptOssForCausalLM": "gpt_oss",
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES.values())
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True)
class ModelArch:
    """A Llama-family decoder: RMSNorm, RoPE, GQA, SwiGLU.

    `qkv_bias` covers Qwen2 and `qk_norm` covers Qwen3; the rest is shared with Llama 2/3,
    SmolLM2, TinyLlama and Mistral. The layers in `sliding_layers` attend to the last
    `sliding_window` tokens only (Mistral's and Phi-3's every layer, Qwen2's from
    max_window_layers on, Gemma 3's local ones). Qwen3-MoE (Qwen3's attention)
    and Mixtral (Mistral's) replace the MLP of the layers in `moe_layers` by `num_experts`
    experts of `moe_intermediate_size`, `num_experts_per_tok` of them per token. Phi-3
    (and Phi-4-mini, a phi3 model) fuses the projections in its checkpoints the way our
    layers are fused, and adds longrope and partial rotary embeddings (`rotary_dim`).
    Gemma 3 (engine/models/gemma3.py) sets the fields from `hidden_act` to
    `final_logit_softcapping`, gpt-oss (engine/models/gpt_oss.py) those after them.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    # A query at position p of a layer in sliding_layers sees keys p - sliding_window + 1..p
    # (transformers' kv_idx > q_idx - sliding_window).
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # Whether the top-k routing weights are renormalised to sum to 1 (Mixtral always is).
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    # Rotary embeddings turn the first `rotary_dim` dims of each head and pass the rest
    # through (Phi-4-mini: 3/4 of them); None: the whole head.
    rotary_dim: int | None = None
    # Gemma 3: the MLP's activation ("silu" or "gelu_tanh"), the attention scale's
    # query_pre_attn_scalar (None: head_dim), the sliding layers' own rope theta (None:
    # rope_theta), and the final logits' soft cap.
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None
    final_logit_softcapping: float | None = None
    # gpt-oss: a learned logit per head in each softmax's denominator, an o_proj bias, and
    # its experts' clamped SwiGLU, glu = gate * sigmoid(alpha * gate) (see gpt_oss.py).
    attention_sinks: bool = False
    o_bias: bool = False
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window in tokens, None for a layer that sees everything."""
        sliding = set(self.sliding_layers)
        return tuple(self.sliding_window if i in sliding else None for i in range(self.num_layers))

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends within, where all do (None otherwise): the KV
        cache manager then frees the blocks that fell out of it. A model that mixes sliding
        and full layers keeps all its blocks."""
        if self.sliding_window is None or len(self.sliding_layers) < self.num_layers:
            return None
        return self.sliding_window

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def context_limit(self) -> tuple[int, str]:
        """(the longest sequence we compute as transformers does, why it is shorter than
        max_position_embeddings or "" where it is not): the engine caps max_model_len at it."""
        limits = []
        if self.rope_scaling.get("rope_type") == "longrope":
            # transformers computes a longer sequence with the long factors at every
            # position, its cached ones included: a paged KV cache would have to recompute.
            why = (
                ": its longrope scaling's original_max_position_embeddings; past it the long "
                "factors apply, which pagedserve does not implement"
            )
            limits.append((int(self.rope_scaling["original_max_position_embeddings"]), why))
        limits.append((self.max_position_embeddings, ""))
        return min(limits, key=lambda limit: limit[0])

    @classmethod
    def from_hf_config(cls, config: Any, eos_token_ids: tuple[int, ...] = ()) -> ModelArch:
        """Raises ValueError for a model type or feature we do not implement."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        rope = dict(_rope_parameters(config))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        rope["rope_type"] = rope_type
        if rope_type == "longrope":
            rope.update(_longrope_fields(config, rope))
        if rope_type == "yarn":
            rope.update(_yarn_fields(config, rope))
        if model_type != "gemma3_text" and getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r}; only silu")
        if getattr(config, "mlp_bias", False):
            raise ValueError("MLP biases are not supported")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        qkv_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            rope_scaling=rope,
            max_position_embeddings=getattr(config, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            eos_token_ids=eos_token_ids,
            rotary_dim=_rotary_dim(config, rope, head_dim),
            **_sliding_fields(config),
            **_moe_fields(config),
            **_gemma3_fields(config),
            **_gpt_oss_fields(config),
        )


def _rope_parameters(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    if "full_attention" in params:  # per layer type (Gemma 3): the full layers' rope
        return dict(params["full_attention"])
    return params


def _longrope_fields(config: Any, rope: dict[str, Any]) -> dict[str, Any]:
    """longrope's original context length, and the factor transformers scales cos and sin
    by (from `factor`, else from max_position_embeddings over the original length)."""
    original = rope.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    if original is None or "short_factor" not in rope:
        raise ValueError("longrope needs original_max_position_embeddings and short_factor")
    factor = rope.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"original_max_position_embeddings": int(original), "attention_factor": attention}


def _yarn_fields(config: Any, rope: dict[str, Any]) -> dict[str, Any]:
    """YaRN's factor and the factor transformers scales cos and sin by, as its
    _compute_yarn_parameters resolves them (layers.rope_inv_freq reads the rest)."""
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or config.max_position_embeddings / original
    attention = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention is None:
        if mscale and mscale_all_dim:
            attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention = get_mscale(factor)
    return {"factor": float(factor), "attention_factor": float(attention)}


def _rotary_dim(config: Any, rope: dict[str, Any], head_dim: int) -> int | None:
    """How many of a head's dims the rotary embedding turns, where that is not all of them.
    Only transformers' Phi-3 code passes the rest through; other model types refuse it."""
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if factor is None or float(factor) == 1.0:
        return None
    dim = int(head_dim * float(factor))
    if config.model_type != "phi3" or dim <= 0 or dim % 2:
        raise ValueError(
            f"unsupported partial_rotary_factor {factor} for {config.model_type!r} (head_dim "
            f"{head_dim}): only phi3 models may turn part of a head, an even number of dims"
        )
    return dim


def _sliding_fields(config: Any) -> dict[str, Any]:
    """The sliding window and the layers it applies to, as transformers' modeling code reads
    them: every layer's, unless the config lists `layer_types` (Qwen2 and Qwen3 from
    max_window_layers on, Gemma 3's local layers); none where a Qwen config does not set
    use_sliding_window."""
    window = getattr(config, "sliding_window", None)
    qwen = config.model_type in ("qwen2", "qwen3", "qwen3_moe")
    if window is None or (qwen and not getattr(config, "use_sliding_window", False)):
        return {}
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"unsupported layer types {sorted(unknown)}")
    sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    return {"sliding_window": int(window), "sliding_layers": sliding}


def _gemma3_fields(config: Any) -> dict[str, Any]:
    """Gemma 3's departures from Llama (see ModelArch); raises ValueError for options of
    its config that transformers' Gemma 3 runs and pagedserve does not."""
    if config.model_type != "gemma3_text":
        return {}
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")
    if config.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported activation {config.hidden_activation!r}")
    local = dict(config.rope_parameters.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported rope type {local['rope_type']!r} for the sliding layers")
    return dict(
        hidden_act="gelu_tanh",
        query_pre_attn_scalar=float(config.query_pre_attn_scalar),
        local_rope_theta=float(local["rope_theta"]),
        final_logit_softcapping=config.final_logit_softcapping,
    )


def _gpt_oss_fields(config: Any) -> dict[str, Any]:
    """gpt-oss's departures from Llama: sinks, biases and its experts (every layer's)."""
    if config.model_type != "gpt_oss":
        return {}
    quant = getattr(config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else quant.quant_method
    if method is not None:
        raise ValueError(
            f"gpt-oss weights quantized as {method!r} are not supported; serve a checkpoint "
            "with float (bfloat16) experts"
        )
    return dict(
        attention_sinks=True,
        o_bias=bool(config.attention_bias),
        swiglu_alpha=float(config.swiglu_alpha),
        swiglu_limit=float(config.swiglu_limit),
        num_experts=config.num_local_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.intermediate_size,
        moe_layers=tuple(range(config.num_hidden_layers)),
    )


def _moe_fields(config: Any) -> dict[str, Any]:
    """The sparse MLPs' facts, as transformers' modeling code reads them (none for a dense
    model). Every Mixtral layer is sparse and renormalises its top-k weights; a Qwen3-MoE
    layer is sparse unless listed in `mlp_only_layers` or off the `decoder_sparse_step`
    grid, and renormalises only with `norm_topk_prob`. Neither has a shared expert."""
    num_layers = config.num_hidden_layers
    if config.model_type == "mixtral":
        return dict(
            num_experts=config.num_local_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.intermediate_size,
            norm_topk_prob=True,
            moe_layers=tuple(range(num_layers)),
        )
    if config.model_type != "qwen3_moe" or config.num_experts <= 0:
        return {}
    dense = set(config.mlp_only_layers or ())
    step = config.decoder_sparse_step
    return dict(
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=bool(config.norm_topk_prob),
        moe_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
    )
