"""engine/models/weight_arena.py: a CPU model's step weights in one huge-page mapping, in the
order a step reads them, with the dense copies after them. (That the outputs do not change
is what every greedy test against transformers checks: each loads through it.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.backend import allocate_kv_cache
from engine.config import QuantConfig
from engine.models import llama
from engine.models.layers import Linear
from engine.models.llama import DecoderModel
from engine.models.loader import load_model
from engine.models.quantized import TiledWeight
from engine.ops import hugepages
from tests.tiny_models import make_tiny_model


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def quantized_tensors(w: TiledWeight) -> list[torch.Tensor]:
    return [t for t in (w.qweight, w.scales, w.mins) if t is not None]


def step_tensors(model: DecoderModel) -> list[torch.Tensor]:
    """What a small step reads, in the order it reads it."""
    tensors: list[torch.Tensor] = []
    for layer in model.layers:
        for module in layer.modules():
            if isinstance(module, Linear):
                if module.quantized is not None:
                    tensors += quantized_tensors(module.quantized)
                elif module.tiled is not None:
                    tensors.append(module.tiled)
                elif module.weight is not None:
                    tensors.append(module.weight)
            else:
                tensors += list(module.parameters(recurse=False))
    return [*tensors, model.norm.weight]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float_model_reads_one_mapping_in_order(tmp_path: Path, dtype: torch.dtype) -> None:
    model, _ = load_model(make_tiny_model("llama", tmp_path), dtype, "cpu")
    tensors = step_tensors(model)
    assert len({storage(t) for t in tensors}) == 1
    assert tensors[0].data_ptr() % hugepages.HUGE_PAGE == 0
    starts = [t.data_ptr() for t in tensors]
    assert starts == sorted(starts)
    # The tied head (the embedding, or its tiled copy) comes after the last layer's norm.
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    if model.dense_head is not None:
        head = model.dense_head.tiled
    assert head is not None and storage(head) == storage(tensors[0])
    assert head.data_ptr() > starts[-1]


def test_the_quantized_file_keeps_its_head_tied_and_its_copies_last(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quant = QuantConfig("gguf", dense_copy=True)
    model, _ = load_model(default_model_dir, torch.bfloat16, "cpu", quant)
    head = model.quantized_head
    assert head is not None and head is model.quantized_embed  # lookups read the same table
    tensors = step_tensors(model) + quantized_tensors(head)
    linears = [m for m in model.layers.modules() if isinstance(m, Linear)]
    assert model.dense_head is not None
    copies = [m.tiled for m in [*linears, model.dense_head]]
    assert all(c is not None for c in copies)
    assert len({storage(t) for t in tensors + copies}) == 1  # type: ignore[arg-type]
    assert max(t.data_ptr() for t in tensors) < min(c.data_ptr() for c in copies)  # type: ignore[union-attr]
    # Moved, not changed: the same tensors as a load that leaves them where they are.
    monkeypatch.setattr(llama, "gather_weights", lambda model: 0)
    unmoved, _ = load_model(default_model_dir, torch.bfloat16, "cpu", quant)
    assert unmoved.quantized_head is not None
    before = step_tensors(unmoved) + quantized_tensors(unmoved.quantized_head)
    assert len({storage(t) for t in before}) > 1
    assert all(torch.equal(a, b) for a, b in zip(tensors, before, strict=True))


def test_the_cpu_kv_cache_is_zeros_in_huge_pages() -> None:
    cache = allocate_kv_cache(2, 64, 16, 3, 64, torch.bfloat16, "cpu")
    assert cache.shape == (2, 2, 64, 16, 3, 64) and cache.dtype == torch.bfloat16
    assert cache.is_contiguous() and cache.data_ptr() % hugepages.HUGE_PAGE == 0
    assert int(cache.count_nonzero()) == 0
