"""engine.models.gguf_file.GGUFFile against gguf's own GGUFReader: the same tensors (name,
type, shape, dtype, bytes) and the same scalar metadata, on files with every metadata type
and the tensor types a model file holds; and clear errors for files it cannot read."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.models.gguf_file import GGUFFile
from tests.tiny_gguf import make_tiny_gguf

Q = gguf.GGMLQuantizationType


def every_kind_of_file(path: Path, alignment: int | None = None) -> Path:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "café ✓")
    writer.add_string("t.empty", "")
    writer.add_array("t.strings", ["a", "", "longer string ñ"] * 1000)
    writer.add_array("t.ints", list(range(5000)))
    writer.add_array("t.floats", [0.5, -1.5])
    writer.add_array("t.nested", [[1, 2], [3, 4, 5]])
    writer.add_array("t.none", [])
    writer.add_string("t.after", "the arrays are walked past correctly")
    writer.add_tensor("f32", rng.standard_normal((3, 5, 7)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 64)).astype(np.float16))
    writer.add_tensor("i32", np.arange(9, dtype=np.int32))
    for kind in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.BF16, Q.Q6_K):
        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (6, 256 // block * size), dtype=np.uint8)
        writer.add_tensor(f"q.{kind.name}", raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_same_as_gguf(path: Path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type, a.name
        assert a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert a.data.tobytes() == b.data.tobytes(), a.name
        assert not a.data.flags.writeable, a.name
    scalars = {
        key: field.contents()
        for key, field in theirs.fields.items()
        if not key.startswith("GGUF.") and field.types[0] != gguf.GGUFValueType.ARRAY
    }
    assert ours.metadata == scalars
    assert ours.data_offset == theirs.data_offset
    return ours


def test_every_value_type_and_tensor_type_reads_as_gguf_reads_it(tmp_path: Path) -> None:
    ours = assert_same_as_gguf(every_kind_of_file(tmp_path / "all.gguf"))
    assert ours.metadata["t.str"] == "café ✓" and ours.metadata["t.u64"] == 2**63 + 5
    assert ours.metadata["t.after"] == "the arrays are walked past correctly"
    assert "t.strings" not in ours.metadata  # arrays are skipped, not read
    assert len(ours.tensors) == 8


def test_a_custom_alignment_moves_the_data(tmp_path: Path) -> None:
    ours = assert_same_as_gguf(every_kind_of_file(tmp_path / "aligned.gguf", alignment=256))
    assert ours.data_offset % 256 == 0


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_a_model_file_reads_as_gguf_reads_it(tmp_path: Path, kind: str) -> None:
    path, _ = make_tiny_gguf(kind, tmp_path / kind, "Q4_1", "Q8_0")
    architecture = "llama" if kind == "mixtral" else "qwen3moe"
    assert GGUFFile(path).metadata["general.architecture"] == architecture
    assert_same_as_gguf(path)


def test_files_it_cannot_read_say_why(tmp_path: Path) -> None:
    good = every_kind_of_file(tmp_path / "good.gguf").read_bytes()
    cases = {
        "not a GGUF file": b"GGML" + good[4:],
        "GGUF version 0x3000000 (big-endian": good[:4] + struct.pack("<I", 3 << 24) + good[8:],
        "GGUF version 0x1 (unsupported)": good[:4] + struct.pack("<I", 1) + good[8:],
        "runs past the end of the file": good[:-100],
    }
    for message, data in cases.items():
        path = tmp_path / "bad.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            GGUFFile(path)
