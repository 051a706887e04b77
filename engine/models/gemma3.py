"""Gemma 3's text decoder (Gemma3ForCausalLM) on the Llama-family building blocks.

What differs from llama.py, as transformers' Gemma 3 computes it:

- the embeddings are scaled by sqrt(hidden_size), rounded to the model's dtype;
- every RMSNorm scales by (1 + weight): the loader adds the 1 to the checkpoint's weights
  (in float32, rounded once), so the norms run as Llama's;
- four norms a layer: the attention's and the MLP's outputs are normed before they join
  the residual stream (post_attention, post_feedforward), and their inputs too (input,
  pre_feedforward); queries and keys are normed per head as Qwen3's;
- the MLP is GeGLU (gelu with the tanh approximation), the attention scale
  query_pre_attn_scalar ** -0.5;
- the sliding (local) layers turn queries and keys with their own rope theta, the full
  (global) layers with rope_theta and the rope scaling;
- the final logits are soft-capped, cap * tanh(logits / cap), where the config sets one.

Attention logit soft-capping (which Gemma 3 leaves unset) is refused by ModelArch.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.models.arch import ModelArch
from engine.models.layers import MLP, RMSNorm, RotaryEmbedding
from engine.models.llama import Attention, DecoderModel


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        eps = arch.rms_norm_eps
        self.input_layernorm = RMSNorm(arch.hidden_size, eps)
        self.self_attn = Attention(arch, layer_idx)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, eps)
        self.mlp = MLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As llama.DecoderLayer.forward: (this layer's normed MLP output, the residual
        before it), summed by the next norm."""
        if residual is None:  # the first layer: x is the embeddings
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, cos, sin, attn))
        h, residual = self.pre_feedforward_layernorm.add_forward(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3Model(DecoderModel):
    """DecoderModel with Gemma 3's layers, embedding scale, local rope and logit cap."""

    fuses_layers = False  # the native layer op computes Llama's layer, not this one

    def __init__(self, arch: ModelArch, lm_head: bool = True) -> None:
        if arch.local_rope_theta is None:
            raise ValueError("a Gemma 3 model needs its sliding layers' rope theta")
        super().__init__(arch, lm_head)
        self.rotary_local = RotaryEmbedding(arch.head_dim, arch.local_rope_theta, {})
        self.embed_scale = arch.hidden_size**0.5

    def make_layer(self, arch: ModelArch, layer_idx: int) -> nn.Module:
        return Gemma3DecoderLayer(arch, layer_idx)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """input_ids, positions: (num_tokens,). Returns (num_tokens, hidden_size)."""
        x = self.embed(input_ids)
        rope_global = self.rotary(positions, x.dtype)
        rope_local = self.rotary_local(positions, x.dtype)
        residual = None
        for layer, window in zip(self.layers, self.arch.layer_windows, strict=True):
            cos, sin = rope_global if window is None else rope_local
            x, residual = layer(x, residual, cos, sin, attn)
        assert residual is not None, "Gemma 3 has layers"
        return self.norm.add_forward(x, residual)[0]

    def screens_head(self) -> bool:
        return self.arch.final_logit_softcapping is None  # as greedy_tokens

    def greedy_tokens(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        # Soft-capping keeps the order but can make ties of logits that had none.
        if self.arch.final_logit_softcapping is not None:
            return None
        return super().greedy_tokens(hidden, vocab_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.arch.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


def is_gemma3_norm(name: str) -> bool:
    """Whether checkpoint tensor `name` is the weight of one of Gemma 3's norms, which scale
    by (1 + weight)."""
    return name.endswith("norm.weight")
