"""Greedy tokens from the bfloat16 LM head without its logits (bf16_linear_argmax in
engine/ops/csrc/bf16_linear_ops.cpp): the same index as numpy's argmax over the bfloat16
logits bf16_linear returns, in every instruction set built, on ties, NaN and infinities, past
the valid columns, and on any thread count."""

from __future__ import annotations

import pytest
import torch

from engine.models.layers import tile_bf16_weight
from engine.ops.loader import native_kernels
from tests.isas import isa_params
from tests.threads import torch_threads

pytestmark = pytest.mark.skipif(not native_kernels().available, reason="no native kernels")

ISAS = isa_params()


def expected(x: torch.Tensor, tiled: torch.Tensor, n: int, n_valid: int, isa: str) -> list[int]:
    logits = torch.ops.pagedserve.bf16_linear(x, tiled, n, isa).float()[:, :n_valid]
    return logits.numpy().argmax(axis=-1).tolist()


def argmax(x: torch.Tensor, tiled: torch.Tensor, n: int, n_valid: int, isa: str) -> list[int]:
    tokens = torch.ops.pagedserve.bf16_linear_argmax(x, tiled, n, n_valid, isa)
    assert tokens.dtype == torch.int64 and tokens.shape == (len(x),)
    return tokens.tolist()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("n", "k", "m"), [(16, 2, 1), (37, 64, 1), (3000, 64, 1), (1000, 96, 7), (2050, 64, 130)]
)
def test_each_rows_argmax_is_the_logits_argmax(isa: str, n: int, k: int, m: int) -> None:
    g = torch.Generator().manual_seed(n + k + m)
    weight = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    tiled = tile_bf16_weight(weight)
    assert argmax(x, tiled, n, n, isa) == expected(x, tiled, n, n, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 5, 64])
def test_ties_go_to_the_first_index_and_padding_is_not_a_token(isa: str, m: int) -> None:
    """Rows of W repeated far apart (copies tie exactly, in other tiles and in other threads'
    runs) and a largest row past n_valid, which must not be chosen."""
    g = torch.Generator().manual_seed(m)
    n, k, n_valid = 4000, 64, 3990
    weight = torch.randn(n, k, generator=g).bfloat16() * 0.1
    x = torch.randn(m, k, generator=g).bfloat16()
    best = (x[0].float() / x[0].float().norm()).bfloat16()  # aligned with row 0 of x
    for i in (3001, 700, 2222):  # the lowest of the copies must win
        weight[i] = best
    weight[3995] = best * 4  # larger still, but past n_valid
    tiled = tile_bf16_weight(weight)
    tokens = argmax(x, tiled, n, n_valid, isa)
    assert tokens[0] == 700
    assert tokens == expected(x, tiled, n, n_valid, isa)
    assert argmax(x, tiled, n, n, isa)[0] == 3995


@pytest.mark.parametrize("isa", ISAS)
def test_nan_counts_as_the_largest_and_infinities_order(isa: str) -> None:
    g = torch.Generator().manual_seed(0)
    n, k = 300, 32
    weight = torch.randn(n, k, generator=g).bfloat16()
    weight[[5, 250]] = 0
    weight[5, 0], weight[250, 0] = 1, -1
    x = torch.randn(4, k, generator=g).bfloat16()
    x[0] = float("nan")  # every logit NaN: the first
    x[1, 0] = float("inf")  # +inf at 5 (and others), -inf at 250
    x[2, 0] = -float("inf")  # +inf at 250
    tiled = tile_bf16_weight(weight)
    tokens = argmax(x, tiled, n, n, isa)
    assert tokens[0] == 0
    assert tokens == expected(x, tiled, n, n, isa)
    logits = torch.ops.pagedserve.bf16_linear(x, tiled, n, isa).float()
    assert logits[1, tokens[1]] == float("inf") and logits[2, tokens[2]] == float("inf")


@pytest.mark.parametrize("m", [1, 64, 130])
def test_any_thread_count_gives_the_same_tokens(m: int) -> None:
    g = torch.Generator().manual_seed(m)
    weight = torch.randn(49152, 64, generator=g).bfloat16()
    x = torch.randn(m, 64, generator=g).bfloat16()
    tiled = tile_bf16_weight(weight)
    want = expected(x, tiled, 49152, 49152, native_kernels().isa)
    for threads in (1, 2, 3):
        with torch_threads(threads):
            assert argmax(x, tiled, 49152, 49152, native_kernels().isa) == want


def test_bad_arguments_are_refused() -> None:
    tiled = tile_bf16_weight(torch.randn(40, 64).bfloat16())
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="n_valid"):
        torch.ops.pagedserve.bf16_linear_argmax(x, tiled, 40, 41)
    with pytest.raises(RuntimeError, match="n_valid"):
        torch.ops.pagedserve.bf16_linear_argmax(x, tiled, 40, 0)
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.pagedserve.bf16_linear_argmax(x, tiled, 60, 40)
    assert torch.ops.pagedserve.bf16_linear_argmax(x[:0], tiled, 40, 40).shape == (0,)
