"""A Llama-family decoder written for paged attention.

One class covers Llama 2/3, SmolLM2, TinyLlama, Mistral (sliding window), Qwen2 (qkv
bias), Qwen3 (q/k RMSNorm), Phi-3 (longrope, partial rotary embeddings), and the
mixture-of-experts Qwen3-MoE and Mixtral (sparse MLPs: engine/models/moe.py). Inputs are a
flat batch of tokens from many requests; the attention backend, passed in explicitly, knows
which token belongs to which request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.config import DENSE_COPY_ROWS
from engine.models.arch import ModelArch
from engine.models.fused_layers import (
    FusedLayers,
    fused_layers_available,
    layer_weights,
    run_fused_layers,
    run_fused_model,
)
from engine.models.head_screen import SCREEN_ROWS, HeadScreen, build_head_screen
from engine.models.layers import (
    MLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    tiled_linear,
)
from engine.models.lora_layers import LoRAStep
from engine.models.moe import SparseMoE, grouped_gemm_runs
from engine.models.quantized import (
    MAX_KERNEL_ROWS,
    QuantizedWeight,
    TiledWeight,
    dequantize,
    pack_tiles,
    quantized_linear,
)
from engine.models.weight_arena import gather_weights
from engine.ops import native_ops


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = arch.num_heads, arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.window = arch.layer_windows[layer_idx]  # the backend applies it; fused layers too
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.qkv_proj = Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size, arch.qkv_bias)
        self.o_proj = Linear(arch.q_size, arch.hidden_size, arch.o_bias)
        # gpt-oss: each head's sink logit, which the attention backend applies.
        self.sinks = (
            nn.Parameter(torch.empty(arch.num_heads), requires_grad=False)
            if arch.attention_sinks
            else None
        )
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, q_size + 2 * kv_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        native_ops.apply_rope_(q, k, cos, sin)  # in place, in the qkv buffer
        out = attn.forward(self.layer_idx, q, k, v)  # (T, num_heads, head_dim)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer_idx)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp: MLP | SparseMoE = (
            SparseMoE(arch)
            if layer_idx in arch.moe_layers
            else MLP(arch.hidden_size, arch.intermediate_size)
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried unsummed: returns (this layer's MLP output, the
        residual before it); the next norm adds them, which fuses the add into the norm."""
        if residual is None:  # the first layer: x is the embeddings
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, attn)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """forward: token ids and positions -> final hidden states; compute_logits on a subset.

    Without `lm_head` (an embedding model: its hidden states are the output) there are no
    logits to compute, and no head weight, tied or not. A subclass with other layers
    (gemma3.py) overrides `make_layer`, and sets `fuses_layers` False where the native layer
    op (fused_layers.py) does not compute them.
    """

    fuses_layers = True

    def make_layer(self, arch: ModelArch, layer_idx: int) -> nn.Module:
        return DecoderLayer(arch, layer_idx)

    def __init__(self, arch: ModelArch, lm_head: bool = True) -> None:
        super().__init__()
        self.arch = arch
        self.has_lm_head = lm_head
        self.embed_tokens = nn.Parameter(
            torch.empty(arch.vocab_size, arch.hidden_size), requires_grad=False
        )
        self.rotary = RotaryEmbedding(
            arch.head_dim, arch.rope_theta, arch.rope_scaling, arch.rotary_dim
        )
        self.layers = nn.ModuleList(self.make_layer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = (
            None
            if arch.tie_word_embeddings or not lm_head
            else nn.Parameter(torch.empty(arch.vocab_size, arch.hidden_size), requires_grad=False)
        )
        # The LM head laid out for its kernel (Linear.pack), or a quantized head's dense copy
        # (--quantization-dense-copy); None: the head runs on its plain weight.
        self.dense_head: Linear | None = None
        # The bfloat16 head's int8 screen for greedy steps of a few rows
        # (engine/models/head_screen.py), where the head is tiled for the native kernel.
        self.head_screen: HeadScreen | None = None
        # Quantized embedding table and LM head (engine/models/quantized.py); a tied model
        # whose table is quantized uses it as its head too.
        self.quantized_embed: TiledWeight | None = None
        self.quantized_head: TiledWeight | None = None
        # The layers as native ops (engine/models/fused_layers.py), when they can run so;
        # with dense copies of quantized weights, a second set for steps of many tokens.
        self.fused_layers: FusedLayers | None = None
        self.fused_dense_layers: FusedLayers | None = None
        # Multi-LoRA (engine/lora): the step's adapter segments, which the layers' Linear
        # layers (or the native ops, which hold the same slots) apply.
        self.lora_step: LoRAStep | None = None

    def layer_sinks(self) -> list[torch.Tensor]:
        """Each layer's attention sinks (num_heads,), for the attention backend; empty for a
        model without them."""
        sinks = [getattr(layer.self_attn, "sinks", None) for layer in self.layers]
        return [s.detach() for s in sinks if s is not None]

    def quantize_embedding(self, weight: QuantizedWeight) -> None:
        """Looks tokens up in `weight` from now on (the float table is dropped)."""
        self.quantized_embed = pack_tiles(weight)
        self.register_parameter("embed_tokens", None)
        if self.has_lm_head and self.lm_head is None and self.quantized_head is None:
            self.quantized_head = self.quantized_embed

    def quantize_head(self, weight: QuantizedWeight) -> None:
        """Computes logits with `weight` from now on (an untied float head is dropped)."""
        self.quantized_head = pack_tiles(weight)
        if self.lm_head is not None:
            self.register_parameter("lm_head", None)

    def pack_weights(self, dense_copy: bool = False, tiled: bool = True) -> None:
        """Lays every float linear layer and the LM head out for its kernel: the bfloat16
        dot-product kernel's tiles where it runs (layers.bf16_tileable; not with
        `tiled=False`), else oneDNN's packed layout where oneDNN can
        (layers.onednn_packable). With `dense_copy`, quantized layers and head also keep
        their weights dequantized, for steps of more than DENSE_COPY_ROWS tokens. Call
        once, after loading."""
        dtype = self.norm.weight.dtype
        for module in self.modules():
            if isinstance(module, Linear):
                if dense_copy:
                    module.keep_dense_copy(dtype)
                module.pack(tiled)
        for block in self.layers:  # a GPU's sparse MLPs: grouped GEMMs where they run
            mlp = getattr(block, "mlp", None)
            if isinstance(mlp, SparseMoE) and grouped_gemm_runs(
                self.norm.weight, self.arch.hidden_size, self.arch.moe_intermediate_size
            ):
                mlp.pack_grouped()
        head: torch.Tensor | None = self.embed_tokens if self.lm_head is None else self.lm_head
        if self.quantized_head is not None:
            head = dequantize(self.quantized_head, dtype) if dense_copy else None
        if head is not None and self.has_lm_head:
            layer = Linear(head.shape[1], head.shape[0])
            layer.weight = nn.Parameter(head.detach(), requires_grad=False)
            layer.pack(tiled)
            # A plain float head that no kernel lays out stays where it is (no second handle).
            if layer.weight is None or self.quantized_head is not None:
                self.dense_head = layer
            if layer.tiled is not None and self.quantized_head is None and self.screens_head():
                self.head_screen = build_head_screen(head.detach())
        if self.norm.weight.device.type == "cpu":
            gather_weights(self)
        self.build_fused_layers(dense_copy)

    def build_fused_layers(self, dense_copy: bool) -> None:
        """The layers as native ops, sparse MLPs included, where they can run so and the
        model's layers are ours; again after LoRA slots are attached to the layers
        (engine/lora), so that the ops carry them."""
        if fused_layers_available(self.norm.weight) and self.fuses_layers:
            for block in self.layers:
                if isinstance(block.mlp, SparseMoE):
                    block.mlp.pack_native()
            self.fused_layers = FusedLayers([layer_weights(layer) for layer in self.layers])
            if dense_copy:
                self.fused_dense_layers = FusedLayers(
                    [layer_weights(layer, True) for layer in self.layers]
                )
            if type(self).embed is DecoderModel.embed:  # the embedding is ours too
                embed = self.embed_tokens if self.quantized_embed is None else self.quantized_embed
                for fused in (self.fused_layers, self.fused_dense_layers):
                    if fused is not None:
                        fused.set_ends(embed, self.norm.weight, self.norm.eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(num_tokens,) -> (num_tokens, hidden_size) in the model's dtype."""
        if self.quantized_embed is not None:
            return dequantize(self.quantized_embed, self.norm.weight.dtype, input_ids)
        return F.embedding(input_ids, self.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """input_ids, positions: (num_tokens,). Returns (num_tokens, hidden_size)."""
        fused = self.fused_layers
        if self.fused_dense_layers is not None and len(input_ids) > DENSE_COPY_ROWS:
            fused = self.fused_dense_layers
        native = fused if fused and hasattr(attn, "stack_args") else None
        if native is not None and native.has_ends and len(positions):
            # The whole forward in one native call: the same ops as below.
            cos, sin = self.rotary.tables(positions, self.norm.weight.dtype)
            return run_fused_model(native, input_ids, positions, cos, sin, attn, self.lora_step)
        x = self.embed(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        residual = None
        if native is not None:
            x, residual = run_fused_layers(native, x, cos, sin, attn, self.lora_step)
        else:
            for layer in self.layers:
                x, residual = layer(x, residual, cos, sin, attn)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.add_forward(x, residual)[0]

    def screens_head(self) -> bool:
        """Whether greedy_tokens may screen a tiled bfloat16 head (head_screen.py): a model
        whose greedy tokens never come from the head's kernel builds no screen."""
        return True

    def greedy_tokens(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """(n,) each row's argmax over compute_logits' first `vocab_size` columns, without
        the logits (n, vocab) and their float32 copy, where the head runs on the bfloat16
        kernel or on the quantized one; else None (compute_logits, then an argmax). The
        same tokens: the kernel compares the logits that compute_logits would return."""
        dense = self.dense_head
        head = self.quantized_head
        if head is not None and (dense is None or len(hidden) <= DENSE_COPY_ROWS):
            # compute_logits' quantized kernel, or its dense path past MAX_KERNEL_ROWS rows.
            if len(hidden) > MAX_KERNEL_ROWS:
                return None
            return native_ops.quant_linear_argmax(hidden, head.kernel_args(), vocab_size)
        if dense is None or dense.tiled is None or dense.bias is not None or dense.lora is not None:
            return None
        screen = self.head_screen
        if screen is not None and len(hidden) <= SCREEN_ROWS:
            return native_ops.bf16_linear_argmax_screened(
                hidden, dense.tiled, dense.out_features, vocab_size, screen.weight, screen.bounds
            )
        return native_ops.bf16_linear_argmax(hidden, dense.tiled, dense.out_features, vocab_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden_size) -> (n, vocab_size) float32 logits."""
        assert self.has_lm_head, "an embedding model computes no logits"
        dense = self.dense_head
        if self.quantized_head is not None and (dense is None or len(hidden) <= DENSE_COPY_ROWS):
            return quantized_linear(hidden, self.quantized_head, out_dtype=torch.float32)
        if (
            dense is not None
            and dense.tiled is not None
            and dense.bias is None
            and dense.lora is None
        ):
            # float32 straight from the kernel: the same numbers as .float() of its bfloat16
            # logits, without a second (n, vocab) pass (and, at a long prompt's logprobs,
            # another 100 MB of fresh pages to fault in).
            return tiled_linear(hidden, dense.tiled, dense.out_features, torch.float32)
        if dense is not None:
            return dense(hidden).float()
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, weight).float()
