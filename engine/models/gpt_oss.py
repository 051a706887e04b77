"""gpt-oss (GptOssForCausalLM) on the Llama-family building blocks.

What differs from llama.py, as transformers' gpt-oss computes it:

- attention has biases on q, k, v and o, and a sink per head: a learned logit in each
  softmax's denominator (engine/attention/torch_backend.py applies it; the other backends
  refuse such a model);
- layers alternate sliding-window and full attention (`layer_types`), rope is YaRN;
- every layer's MLP is a mixture of experts: a router with a bias picks the top-k experts
  by logit and weights them by the softmax of those k logits; each expert is a clamped
  SwiGLU with biases, over gate and up columns interleaved in one matrix:

      gate, up = (x W_gu + b_gu)[..., 0::2], [..., 1::2]
      gate = min(gate, limit);  up = clamp(up, -limit, limit)
      out = ((up + 1) * gate * sigmoid(alpha * gate)) W_d + b_d

The experts keep transformers' layout, (experts, in, out), and run one at a time on the
tokens routed to them.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.models.arch import ModelArch
from engine.models.layers import Linear, RMSNorm
from engine.models.llama import Attention, DecoderModel


class GptOssExperts(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        e, h, i = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, i, h), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)
        self.alpha, self.limit = arch.swiglu_alpha, arch.swiglu_limit

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on its tokens x: (n, hidden) -> (n, hidden)."""
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]  # (n, 2 * I)
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return ((up + 1) * glu) @ self.down_proj[e] + self.down_proj_bias[e]


class GptOssMoE(nn.Module):
    """Router (with a bias) and experts; forward: (T, hidden) -> (T, hidden)."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.router = Linear(arch.hidden_size, arch.num_experts, bias=True)
        self.experts = GptOssExperts(arch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)  # (T, experts)
        top, chosen = torch.topk(logits, self.top_k, dim=-1)  # (T, k)
        weights = torch.softmax(top, dim=-1)
        out = torch.zeros_like(x)
        # Experts that got tokens, read on the host once: one small matmul pair each.
        for e in torch.unique(chosen).tolist():
            rows, slot = torch.where(chosen == e)
            y = self.experts.expert(e, x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(x.dtype))
        return out


class GptOssDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer_idx)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = GptOssMoE(arch)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As llama.DecoderLayer.forward."""
        if residual is None:  # the first layer: x is the embeddings
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, attn)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class GptOssModel(DecoderModel):
    """DecoderModel with gpt-oss's layers (attention sinks, its experts)."""

    fuses_layers = False  # the native layer op has neither sinks nor these experts

    def make_layer(self, arch: ModelArch, layer_idx: int) -> nn.Module:
        return GptOssDecoderLayer(arch, layer_idx)
