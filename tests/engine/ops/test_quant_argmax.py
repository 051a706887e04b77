"""Greedy tokens from a quantized LM head without its logits (quant_linear_argmax in
engine/ops/csrc/quant_ops.cpp): the same index as numpy's argmax (the sampler's argmax_rows)
over the float32 logits compute_logits takes from quant_linear, in every instruction set
built, for 4- and 8-bit heads, on ties, signed zeros, NaN and infinities, past the valid
columns, and on any thread count."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from engine.config import DENSE_COPY_ROWS, QuantConfig
from engine.models.loader import load_model
from engine.models.quantized import (
    MAX_KERNEL_ROWS,
    QuantizedWeight,
    TiledWeight,
    from_gguf,
    pack_tiles,
    quantize_int4,
    quantize_int8,
)
from engine.ops.loader import native_kernels
from tests.isas import isa_params
from tests.threads import torch_threads
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not native_kernels().available, reason="no native kernels")

ISAS = isa_params()
DTYPES = [torch.float32, torch.bfloat16]


def quantize(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    if fmt == "int4":
        return quantize_int4(w, 64 if w.shape[1] % 64 == 0 else 32)
    if fmt == "int8":
        return quantize_int8(w)
    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    return from_gguf(fmt, gguf.quants.quantize(w.numpy(), qtype), tuple(w.shape))


def logits(x: torch.Tensor, w: TiledWeight, isa: str) -> torch.Tensor:
    """compute_logits' logits: float32 from the kernel."""
    return torch.ops.pagedserve.quant_linear(x, *w.kernel_args(), isa=isa, out_dtype=torch.float32)


def expected(x: torch.Tensor, w: TiledWeight, n_valid: int, isa: str) -> list[int]:
    """The logits' argmax as argmax_rows takes it (numpy's)."""
    return logits(x, w, isa)[:, :n_valid].numpy().argmax(axis=-1).tolist()


def argmax(x: torch.Tensor, w: TiledWeight, n_valid: int, isa: str) -> list[int]:
    tokens = torch.ops.pagedserve.quant_linear_argmax(x, *w.kernel_args(), n_valid, isa)
    assert tokens.dtype == torch.int64 and tokens.shape == (len(x),)
    return tokens.tolist()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1", "int4", "int8"])
@pytest.mark.parametrize(("n", "k", "m"), [(16, 32, 1), (37, 64, 1), (3000, 64, 3), (1000, 96, 16)])
def test_each_rows_argmax_is_the_logits_argmax(
    isa: str, dtype: torch.dtype, fmt: str, n: int, k: int, m: int
) -> None:
    g = torch.Generator().manual_seed(n + k + m)
    w = pack_tiles(quantize(torch.randn(n, k, generator=g), fmt))
    x = torch.randn(m, k, generator=g).to(dtype)
    assert argmax(x, w, n, isa) == expected(x, w, n, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("m", [1, 5, 12])
def test_ties_go_to_the_first_index_and_padding_is_not_a_token(
    isa: str, dtype: torch.dtype, m: int
) -> None:
    """Rows of W repeated far apart (copies tie exactly, in other tiles and in other threads'
    runs) and a largest row past n_valid, which must not be chosen."""
    g = torch.Generator().manual_seed(m)
    n, k, n_valid = 4000, 64, 3990
    weight = torch.randn(n, k, generator=g) * 0.1
    x = torch.randn(m, k, generator=g).to(dtype)
    best = x[0].float() / x[0].float().norm()  # aligned with row 0 of x
    for i in (3001, 700, 2222):  # the lowest of the copies must win
        weight[i] = best
    weight[3995] = best * 4  # larger still, but past n_valid
    w = pack_tiles(quantize(weight, "Q8_0"))
    tokens = argmax(x, w, n_valid, isa)
    assert tokens[0] == 700
    assert tokens == expected(x, w, n_valid, isa)
    assert argmax(x, w, n, isa)[0] == 3995


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_signed_zeros_tie_nan_is_the_largest_and_infinities_order(
    isa: str, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(0)
    n, k = 300, 32
    weight = torch.randn(n, k, generator=g)
    weight[[5, 250]] = 0
    weight[5, 0], weight[250, 0] = 1, -1
    w = pack_tiles(quantize(weight, "Q8_0"))
    x = torch.randn(5, k, generator=g).to(dtype)
    x[0] = float("nan")  # every logit NaN: the first
    x[1, 0] = float("inf")  # +inf at 5 (and others), -inf at 250, NaN where w[:, 0] is 0
    x[2, 0] = -float("inf")  # +inf at 250
    x[3] = 0  # every logit zero: the first
    x[4] = 0
    x[4, 0] = -1e-30  # -0 or tiny negatives (row 5: -1e-30) beside +0 (zero rows)
    tokens = argmax(x, w, n, isa)
    assert tokens[0] == 0 and tokens[3] == 0
    assert tokens == expected(x, w, n, isa)
    y = logits(x, w, isa)
    # The cases are there: each of rows 0-2 has non-finite logits (infinities, or NaN where
    # an infinity meets a zero weight, or where a kernel's int16 rows cannot hold one).
    assert y[0].isnan().all() and (~y[1:3].isfinite()).any(dim=1).all()


@pytest.mark.parametrize("m", [1, 9])
def test_any_thread_count_gives_the_same_tokens(m: int) -> None:
    g = torch.Generator().manual_seed(m)
    w = pack_tiles(quantize(torch.randn(49152, 64, generator=g), "Q8_0"))
    x = torch.randn(m, 64, generator=g).bfloat16()
    isa = native_kernels().isa
    want = expected(x, w, 49152, isa)
    for threads in (1, 2, 3):
        with torch_threads(threads):
            assert argmax(x, w, 49152, isa) == want


def test_bad_arguments_are_refused() -> None:
    w = pack_tiles(quantize(torch.randn(40, 64), "Q8_0"))
    x = torch.randn(2, 64)
    op = torch.ops.pagedserve.quant_linear_argmax
    with pytest.raises(RuntimeError, match="n_valid"):
        op(x, *w.kernel_args(), 41)
    with pytest.raises(RuntimeError, match="n_valid"):
        op(x, *w.kernel_args(), 0)
    with pytest.raises(RuntimeError, match="x must be"):
        op(torch.randn(2, 32), *w.kernel_args(), 40)
    assert op(x[:0], *w.kernel_args(), 40).shape == (0,)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("dense_copy", [False, True], ids=["quantized", "dense-copy"])
def test_a_quantized_heads_greedy_tokens_are_its_logits_argmax(
    tmp_path: Path, dtype: torch.dtype, dense_copy: bool
) -> None:
    """DecoderModel.greedy_tokens on an int8 head: the kernel's argmax wherever
    compute_logits runs the quantized kernel, and None (the logits) past it."""
    quant = QuantConfig("int8", lm_head=True, dense_copy=dense_copy)
    model, _ = load_model(make_tiny_model("llama", tmp_path), dtype, "cpu", quant)
    assert model.quantized_head is not None
    vocab = model.arch.vocab_size - 3  # a tokenizer's vocabulary may be the smaller
    g = torch.Generator().manual_seed(7)
    for rows in (1, DENSE_COPY_ROWS, MAX_KERNEL_ROWS, MAX_KERNEL_ROWS + 1):
        hidden = torch.randn(rows, model.arch.hidden_size, generator=g).to(dtype)
        with torch.inference_mode():
            tokens = model.greedy_tokens(hidden, vocab)
            want = model.compute_logits(hidden)[:, :vocab].numpy().argmax(axis=-1).tolist()
        quantized = rows <= (DENSE_COPY_ROWS if dense_copy else MAX_KERNEL_ROWS)
        if not quantized:  # the dense copy's head, or compute_logits' dense path
            assert tokens is None or tokens.tolist() == want
            continue
        assert tokens is not None and tokens.tolist() == want
