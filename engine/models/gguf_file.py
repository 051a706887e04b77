"""A GGUF file's tensor table and scalar metadata, read without parsing its arrays.

gguf's GGUFReader builds a numpy view for every part of every metadata value: for the
bundled SmolLM2 file, whose tokenizer vocabulary and merges are two arrays of 49,152 and
48,900 strings, that is 247,000 views and 3 s of a server's start, for a model whose
tokenizer is read from tokenizer.json anyway. The loader needs only the tensors and a few
scalars (the architecture, the expert counts): this reader walks past the arrays (a length
each, for strings) and keeps the rest. Its tensors are what GGUFReader's are, array for
array (the tests compare them): numpy views of the mapped file, floats and integers in
their own dtype, every other type as its raw bytes, (..., bytes per row).

The file's byte order must be the host's (little-endian): the quantized kernels read the
blocks as they lie.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF's metadata value types (gguf.GGUFValueType's numbering): the scalars' struct codes.
_SCALARS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i",  # uint8 ... int32
    6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",  # float32, bool, uint64, int64, float64
}  # fmt: skip
_STRING, _ARRAY = 8, 9
# Tensor types held in their own numpy dtype (GGUFReader's choice); the rest are bytes.
_NUMPY_TYPES: dict[str, type[np.generic]] = {
    "F32": np.float32, "F16": np.float16, "F64": np.float64,
    "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64,
}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # as the file lists it: (K, N, ...), the reverse of numpy's
    data: np.ndarray  # a read-only view of the mapped file


class GGUFFile:
    """The file at `path`: `metadata` (every scalar and string value; arrays are skipped)
    and `tensors`, in the file's order."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        self.path = Path(path)
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (its first bytes are {bytes(buf[:4])!r})")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in SUPPORTED_VERSIONS:
            swapped = version & 0xFFFF == 0
            why = "big-endian; this reader needs little-endian" if swapped else "unsupported"
            raise ValueError(f"{path}: GGUF version {version:#x} ({why})")
        self.version = version
        tensor_count, kv_count = struct.unpack_from("<QQ", buf, 8)
        offset = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key, offset = self._string(offset)
            (value_type,) = struct.unpack_from("<I", buf, offset)
            value, offset = self._value(value_type, offset + 4)
            if key in self.metadata:
                raise ValueError(f"{path}: metadata key {key!r} appears twice")
            if value is not _SKIPPED:
                self.metadata[key] = value
        table = []
        for _ in range(tensor_count):
            name, offset = self._string(offset)
            (n_dims,) = struct.unpack_from("<I", buf, offset)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, offset + 4)
            offset += 4 + 8 * n_dims
            type_id, data_offset = struct.unpack_from("<IQ", buf, offset)
            offset += 12
            table.append((name, dims, type_id, data_offset))
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment {alignment!r} is not a power of two")
        self.data_offset = (offset + alignment - 1) // alignment * alignment
        self.tensors: list[GGUFTensor] = []
        names: set[str] = set()
        for name, dims, type_id, data_offset in table:
            if name in names:
                raise ValueError(f"{path}: tensor {name!r} appears twice")
            names.add(name)
            kind = gguf.GGMLQuantizationType(type_id)
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
            count = int(np.prod(dims, dtype=np.int64))
            nbytes = count * type_size // block
            start = self.data_offset + data_offset
            if start + nbytes > len(buf):
                raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
            shape = tuple(reversed(dims))
            dtype = np.dtype(_NUMPY_TYPES.get(kind.name, np.uint8))
            if kind.name not in _NUMPY_TYPES:  # raw blocks: (..., bytes per row)
                shape = gguf.quant_shape_to_byte_shape(shape, kind)
            data = np.frombuffer(buf, dtype, nbytes // dtype.itemsize, start).reshape(shape)
            self.tensors.append(GGUFTensor(name, kind, tuple(int(d) for d in dims), data))

    def _string(self, offset: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._map, offset)
        end = offset + 8 + length
        return self._map[offset + 8 : end].decode("utf-8"), end

    def _value(self, value_type: int, offset: int) -> tuple[Any, int]:
        code = _SCALARS.get(value_type)
        if code is not None:
            (value,) = struct.unpack_from("<" + code, self._map, offset)
            return value, offset + struct.calcsize(code)
        if value_type == _STRING:
            return self._string(offset)
        if value_type == _ARRAY:
            item_type, count = struct.unpack_from("<IQ", self._map, offset)
            return _SKIPPED, self._skip_items(item_type, count, offset + 12)
        raise ValueError(f"{self.path}: unknown GGUF metadata type {value_type} at byte {offset}")

    def _skip_items(self, item_type: int, count: int, offset: int) -> int:
        """The offset after `count` values of `item_type` at `offset`."""
        code = _SCALARS.get(item_type)
        if code is not None:
            return offset + count * struct.calcsize(code)
        if item_type == _STRING:
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):
                offset += 8 + unpack(self._map, offset)[0]
            return offset
        for _ in range(count):  # arrays of arrays, or an unknown type (which raises)
            _, offset = self._value(item_type, offset)
        return offset


_SKIPPED = object()  # an array's value: not read
