"""RotaryEmbedding on the CPU looks cos and sin up in tables it grows as positions grow:
the tables must hold exactly what computing them for the step's positions gives."""

from __future__ import annotations

import pytest
import torch

from engine.models.layers import RotaryEmbedding

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scaling", [{}, LLAMA3], ids=["default", "llama3"])
def test_table_lookup_equals_computing(dtype: torch.dtype, scaling: dict) -> None:
    rope = RotaryEmbedding(64, 500000.0, scaling)
    generator = torch.Generator().manual_seed(0)
    # Small positions first, then past the first table (it must grow), then a mix.
    for high in (100, 5000, 70000, 3000):
        positions = torch.randint(0, high, (37,), generator=generator)
        cos, sin = rope(positions, dtype)
        want_cos, want_sin = rope.compute(positions, dtype)
        assert cos.shape == want_cos.shape == (37, 1, 64)
        assert cos.is_contiguous() and sin.is_contiguous()
        assert cos.dtype == sin.dtype == dtype
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert len(rope._tables[dtype][0]) == 1 << 17  # grown to the next power of two past 70000


def test_one_position_and_none() -> None:
    rope = RotaryEmbedding(32, 10000.0, {})
    cos, sin = rope(torch.tensor([4095]), torch.float32)
    want_cos, want_sin = rope.compute(torch.tensor([4095]), torch.float32)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert len(rope._tables[torch.float32][0]) == 4096
    empty = rope(torch.empty(0, dtype=torch.long), torch.float32)
    assert empty[0].shape == (0, 1, 32)
