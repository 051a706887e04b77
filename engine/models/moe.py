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
the same kernels and roundings: `reference` is the Python path it equals. On a GPU in
bfloat16, `grouped` runs every expert of a layer in two grouped GEMMs (torch._grouped_mm
over the experts' stacked weights, pack_grouped); `reference` runs elsewhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, cast

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
        # pack_grouped's stacks: every expert's gate_up_proj (E, 2I, H) and down_proj (E, H, I).
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def pack_native(self) -> None:
        """Runs forward as the native op from now on. Call once the weights are on the CPU
        and laid out for their kernels (Linear.pack), where the native kernels load."""
        self.native = moe_weights(self)

    def pack_grouped(self) -> None:
        """Runs forward as `grouped` from now on: stacks the experts' weights, which become
        views of the stacks (no second copy). Call once the weights are loaded, float."""
        mlps = cast(list[MLP], list(self.experts))
        gate_ups = [e.gate_up_proj.weight for e in mlps]
        downs = [e.down_proj.weight for e in mlps]
        if any(w is None for w in gate_ups + downs):
            raise ValueError("grouped experts need float weights")
        self.stacked = (
            torch.stack(cast(list[torch.Tensor], gate_ups)),
            torch.stack(cast(list[torch.Tensor], downs)),
        )
        for i, expert in enumerate(mlps):
            expert.gate_up_proj.weight = nn.Parameter(self.stacked[0][i], requires_grad=False)
            expert.down_proj.weight = nn.Parameter(self.stacked[1][i], requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (num_tokens, hidden_size) -> the same shape."""
        if self.native is not None and x.device.type == "cpu" and x.is_contiguous():
            return sparse_moe(x, self.native)
        if self.stacked is not None:
            return self.grouped(x)
        return self.reference(x)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (token, expert) pairs sorted by expert: (the expert of each, its token, its
        routing weight in x's dtype), each (T * top_k,)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (T, num_experts)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (T, top_k) each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.flatten()  # (T * top_k,): token t's picks at t * top_k + j
        order = torch.argsort(flat, stable=True)
        return flat[order], order // self.top_k, weights.to(x.dtype).flatten()[order]

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """forward as two grouped GEMMs over the stacked experts (pack_grouped): the pairs'
        rows in expert order, each expert's run on its own, without a sync with the host
        (the experts' row counts stay on the device)."""
        assert self.stacked is not None
        gate_up, down = self.stacked
        experts, tokens, scales = self._route(x)
        counts = torch.zeros(len(self.experts), dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, experts, torch.ones_like(experts, dtype=torch.int32))
        ends = torch.cumsum(counts, 0, dtype=torch.int32)  # each expert's rows end here
        rows = x.index_select(0, tokens)  # (T * top_k, H)
        h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=ends)  # (T * top_k, 2I)
        act = cast(MLP, self.experts[0]).act_and_mul(h)  # (T * top_k, I)
        y = torch._grouped_mm(act, down.transpose(1, 2), offs=ends)
        return torch.zeros_like(x).index_add_(0, tokens, y * scales[:, None])

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """forward in torch, one expert at a time."""
        experts, tokens, scales = self._route(x)
        counts = torch.bincount(experts, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows = tokens[start : start + count]
                y = expert(x.index_select(0, rows))  # (count, hidden_size)
                out.index_add_(0, rows, y * scales[start : start + count, None])
            start += count
        return out


def grouped_gemm_runs(weight: torch.Tensor, hidden_size: int, intermediate_size: int) -> bool:
    """Whether a sparse MLP with weights like `weight` runs as grouped GEMMs: bfloat16 on
    a CUDA GPU of compute capability 9 or more (torch's grouped GEMM kernels), rows 16-byte
    aligned."""
    return (
        weight.is_cuda
        and weight.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(weight.device)[0] >= 9
        and hidden_size % 8 == 0
        and intermediate_size % 8 == 0
    )


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
