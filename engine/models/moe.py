"""The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral.

A router (one linear layer) scores every expert for each token; the token goes to its
top-k experts, weighted by the softmax of the scores (renormalised over the k where the
model says so). Each expert is a SwiGLU MLP. A step groups its tokens by expert, so each
chosen expert runs once, on all of its tokens. Three tokens, top-2:

    token 0 -> e3, e1      token 1 -> e1, e0      token 2 -> e3, e0
    the (token, expert) pairs sorted by expert:  e0: 1 2 | e1: 0 1 | e3: 0 2
    each expert gathers its tokens' rows (index_select), runs on them, scales each row
    by its routing weight and adds it back to its token (index_add_)

Experts run in ascending order, as in transformers, so each token's sum adds its experts'
outputs in the same order. Routing weights are cast to the model's dtype before they scale
an expert's rows, as Qwen3-MoE's transformers code does (Mixtral's scales in float32: in
bfloat16 the two differ by one rounding; in float32 they are the same).

On the CPU with the native kernels, the whole of forward is one native op
(engine/ops/csrc/moe_ops.cpp, packed by pack_native) that computes the same thing, with
the same kernels and roundings: `reference` is the Python path it equals, and the one
that runs elsewhere (a GPU, a torch without the kernels).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from engine.models.arch import ModelArch
from engine.models.fused_layers import moe_weights, sparse_moe
from engine.models.layers import MLP, Linear
from engine.models.quantized import QuantizedWeight

# Mixtral's expert names -> ours (transformers' Qwen3-MoE names).
_MIXTRAL_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.\d+)\.(w[123])\.weight")
# All experts in one 3-D tensor, (num_experts, out, in): transformers 5's own layout.
_STACKED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")


class SparseMoE(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        self.gate = Linear(arch.hidden_size, arch.num_experts)  # the router
        self.experts = nn.ModuleList(
            MLP(arch.hidden_size, arch.moe_intermediate_size) for _ in range(arch.num_experts)
        )
        self.native: Any = None  # the MoeWeights that pack_native made

    def pack_native(self) -> None:
        """Runs forward as the native op from now on. Call once the weights are on the CPU
        and laid out for their kernels (Linear.pack), where the native kernels load."""
        self.native = moe_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (num_tokens, hidden_size) -> the same shape."""
        if self.native is not None and x.device.type == "cpu" and x.is_contiguous():
            return sparse_moe(x, self.native)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """forward in torch, one expert at a time."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (T, num_experts)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (T, top_k) each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.flatten()  # (T * top_k,): token t's picks at t * top_k + j
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k  # (T * top_k,) token ids, grouped by expert
        scales = weights.to(x.dtype).flatten()[order]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows = tokens[start : start + count]
                y = expert(x.index_select(0, rows))  # (count, hidden_size)
                out.index_add_(0, rows, y * scales[start : start + count, None])
            start += count
        return out


def expert_tensors(
    name: str, tensor: torch.Tensor | QuantizedWeight
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """A checkpoint tensor under the per-expert names the loader maps (`mlp.experts.E.
    gate_proj/up_proj/down_proj.weight`): Mixtral's `block_sparse_moe.experts.E.w1/w3/w2`
    renamed, a 3-D stack of every expert's `gate_up_proj` or `down_proj` split into one
    tensor per expert; any other tensor as it is."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    if match := _MIXTRAL_EXPERT.fullmatch(name):
        yield f"{match[1]}.{_MIXTRAL_EXPERTS[match[2]]}.weight", tensor
    elif (match := _STACKED_EXPERTS.fullmatch(name)) and isinstance(tensor, torch.Tensor):
        for expert, weight in enumerate(tensor.unbind(0)):
            yield f"{match[1]}.{expert}.{match[2]}.weight", weight
    else:
        yield name, tensor
