"""Megatron-style tensor parallelism for the Llama-family decoder.

Rank r of N holds 1/N of every matrix and the layers talk through one all-reduce each:

    embed_tokens   vocabulary-parallel: rows [r V/N, (r+1) V/N); ids outside look up
                   zeros; an all-reduce sums the one row that is not
    qkv_proj       column-parallel: query heads [r H/N, ...) and KV heads [r K/N, ...),
                   so attention (and this rank's KV cache) covers its own heads only
    o_proj         row-parallel: its input columns are this rank's heads; all-reduce
    gate_up_proj   column-parallel: rows [r I/N, ...) of gate and of up
    down_proj      row-parallel over the same I/N; all-reduce
    lm_head        vocabulary-parallel: each rank's logits for its rows, gathered on rank 0

Norms, RoPE and the residual stream are replicated: after each all-reduce every rank holds
the same hidden state. Float weights only (see engine/config.py for why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.models.arch import ModelArch
from engine.models.layers import MLP, Linear
from engine.models.llama import DecoderLayer, DecoderModel
from engine.utils import cdiv


@dataclass(frozen=True)
class Shard:
    """This rank's place in the tensor-parallel group."""

    rank: int
    size: int

    def rows(self, total: int) -> tuple[int, int]:
        """[start, end) of an even split of `total` rows (total divisible by size)."""
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of the vocabulary; the last shard may be short (padded to `per`)."""
        per = cdiv(vocab_size, self.size)
        return min(self.rank * per, vocab_size), min((self.rank + 1) * per, vocab_size)


def check_shardable(arch: ModelArch, size: int) -> None:
    """Raises ValueError naming the first dimension that does not split `size` ways."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be positive, got {size}")
    if arch.model_type == "gemma3_text" and size > 1:
        raise ValueError(
            f"--tensor-parallel-size {size} cannot shard a Gemma 3 model (its shards would need "
            "its own layers); use --tensor-parallel-size 1"
        )
    if arch.is_moe and size > 1:
        raise ValueError(
            f"--tensor-parallel-size {size} cannot shard a mixture-of-experts model "
            f"({arch.model_type}): its experts run on one process; use --tensor-parallel-size 1"
        )
    for name, value in (
        ("attention heads", arch.num_heads),
        ("KV heads", arch.num_kv_heads),
        ("intermediate size", arch.intermediate_size),
    ):
        if value % size:
            raise ValueError(
                f"--tensor-parallel-size {size} cannot shard this model: its {value} {name} "
                f"do not divide by {size}"
            )


def shard_arch(arch: ModelArch, size: int) -> ModelArch:
    """The shapes one rank's layers and KV cache have (the vocabulary stays whole: the
    sampler sees gathered logits)."""
    check_shardable(arch, size)
    return replace(
        arch,
        num_heads=arch.num_heads // size,
        num_kv_heads=arch.num_kv_heads // size,
        intermediate_size=arch.intermediate_size // size,
    )


class RowParallelLinear(Linear):
    """A Linear over this rank's share of the input features, summed across ranks."""

    def __init__(self, like: Linear, group: dist.ProcessGroup | None) -> None:
        super().__init__(like.in_features, like.out_features, like.bias is not None)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        dist.all_reduce(out, group=self.group)
        return out


class TensorParallelDecoder(DecoderModel):
    """One rank's shard of a DecoderModel: build it with `from_full`."""

    def __init__(self, arch: ModelArch, shard: Shard, group: dist.ProcessGroup | None) -> None:
        super().__init__(shard_arch(arch, shard.size))
        self.full_vocab = arch.vocab_size
        self.shard = shard
        self.group = group
        self.vocab_start, self.vocab_end = shard.vocab_rows(arch.vocab_size)
        self.vocab_per_rank = cdiv(arch.vocab_size, shard.size)
        table = (self.vocab_per_rank, arch.hidden_size)
        self.embed_tokens = nn.Parameter(torch.zeros(table), requires_grad=False)
        if self.lm_head is not None:
            self.lm_head = nn.Parameter(torch.zeros(table), requires_grad=False)
        # Rank 0 only: tells the other ranks to join the logits collectives that follow.
        self.before_logits: Callable[[torch.Tensor], None] | None = None
        for layer in self.decoder_layers():
            layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, group)
            mlp = _dense_mlp(layer)
            mlp.down_proj = RowParallelLinear(mlp.down_proj, group)

    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]

    @classmethod
    def from_full(
        cls, full: DecoderModel, shard: Shard, group: dist.ProcessGroup | None
    ) -> TensorParallelDecoder:
        """Copies this rank's slices of `full` (float weights, on the CPU, not packed)."""
        model = cls(full.arch, shard, group).to(full.norm.weight.dtype)
        _copy_sharded(model, full, shard)
        return model

    def pack_weights(self, dense_copy: bool = False, tiled: bool = True) -> None:
        super().pack_weights(dense_copy, tiled)
        # The native layer op (fused_layers.py) has no all-reduce after o_proj and
        # down_proj: a shard runs its layers through the Python modules, which do.
        self.fused_layers = self.fused_dense_layers = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        x = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        x.masked_fill_(outside[:, None], 0)
        dist.all_reduce(x, group=self.group)
        return x  # (num_tokens, hidden_size)

    def screens_head(self) -> bool:
        return False  # as greedy_tokens

    def greedy_tokens(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        return None  # every rank's share of the logits meets on rank 0 (compute_logits)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rank 0 gets the (n, vocab_size) logits; the others their own (n, V / N) share."""
        if self.before_logits is not None:
            self.before_logits(hidden)
        local = super().compute_logits(hidden).contiguous()  # (n, V / N) float32
        if self.shard.rank != 0:
            dist.gather(local, None, dst=0, group=self.group)
            return local
        parts = [torch.empty_like(local) for _ in range(self.shard.size)]
        dist.gather(local, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.full_vocab]


def _dense_mlp(layer: DecoderLayer) -> MLP:
    """The layer's MLP, which is dense: check_shardable refuses mixture-of-experts models."""
    assert isinstance(layer.mlp, MLP), "a sparse MLP cannot shard"
    return layer.mlp


def _copy_sharded(model: TensorParallelDecoder, full: DecoderModel, shard: Shard) -> None:
    arch, a = full.arch, model.arch  # the whole model's shapes, one rank's
    with torch.no_grad():
        start, end = model.vocab_start, model.vocab_end
        model.embed_tokens[: end - start].copy_(full.embed_tokens[start:end])
        if model.lm_head is not None and full.lm_head is not None:
            model.lm_head[: end - start].copy_(full.lm_head[start:end])
        model.norm.weight.copy_(full.norm.weight)
        for ours, theirs in zip(model.decoder_layers(), full.layers, strict=True):
            theirs = cast(DecoderLayer, theirs)
            ours.input_layernorm.weight.copy_(theirs.input_layernorm.weight)
            ours.post_attention_layernorm.weight.copy_(theirs.post_attention_layernorm.weight)
            att, full_att = ours.self_attn, theirs.self_attn
            for norm, full_norm in ((att.q_norm, full_att.q_norm), (att.k_norm, full_att.k_norm)):
                if norm is not None and full_norm is not None:
                    norm.weight.copy_(full_norm.weight)
            sections = (arch.q_size, arch.kv_size, arch.kv_size)
            _copy_columns(att.qkv_proj, full_att.qkv_proj, sections, shard)
            _copy_rows(att.o_proj, full_att.o_proj, a.q_size, shard)
            size = arch.intermediate_size
            mlp, full_mlp = _dense_mlp(ours), _dense_mlp(theirs)
            _copy_columns(mlp.gate_up_proj, full_mlp.gate_up_proj, (size, size), shard)
            _copy_rows(mlp.down_proj, full_mlp.down_proj, a.intermediate_size, shard)


def _copy_columns(ours: Linear, full: Linear, sections: tuple[int, ...], shard: Shard) -> None:
    """Column-parallel: this rank's share of each fused section's output rows."""
    assert ours.weight is not None and full.weight is not None
    offset, parts, biases = 0, [], []
    for section in sections:
        start, end = shard.rows(section)
        parts.append(full.weight[offset + start : offset + end])
        if full.bias is not None:
            biases.append(full.bias[offset + start : offset + end])
        offset += section
    ours.weight.copy_(torch.cat(parts))
    if ours.bias is not None:
        ours.bias.copy_(torch.cat(biases))


def _copy_rows(ours: Linear, full: Linear, width: int, shard: Shard) -> None:
    """Row-parallel: the input columns this rank's activations cover."""
    assert ours.weight is not None and full.weight is not None
    start = shard.rank * width
    ours.weight.copy_(full.weight[:, start : start + width])
