"""A fast GGUF header reader: metadata and tensor table, tensor data as memory-mapped views.

Why not ``gguf.GGUFReader``: it builds numpy views for every element of every metadata array,
which takes ~5 s on SmolLM2's 49k-token vocabulary (and transformers' config loader reads the
file through it again). This reader walks the header with ``struct`` over an ``mmap`` (~0.1 s)
and keeps string arrays as their length unless asked for. Data decoding stays with the ``gguf``
package (``gguf.quants.dequantize``, ``GGML_QUANT_SIZES``).

File layout (little-endian, GGUF v2/v3)::

    "GGUF" u32 version | u64 tensor_count | u64 kv_count
    kv_count x (string key, u32 value_type, value)          string = u64 length + utf-8 bytes
    tensor_count x (string name, u32 n_dims, u64 dims[n_dims] (fastest first), u32 ggml_type, u64 offset)
    padding to ``general.alignment`` (default 32), then the data section; offsets are relative to it
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: rows first (GGUF lists dimensions fastest first)
    ggml_type: int
    offset: int  # absolute offset in the file


@dataclass
class GGUFFile:
    """One GGUF file's metadata and tensor table; ``raw(info)`` maps one tensor's bytes."""

    path: Path
    metadata: dict[str, Any]  # string arrays not asked for are replaced by their length (an int)
    tensors: dict[str, GGUFTensorInfo]
    _map: mmap.mmap = field(repr=False)

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """Read-only uint8 view [*shape[:-1], row_bytes] of one tensor's stored blocks."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(f"GGUF tensor {info.name!r} has unknown ggml type id {info.ggml_type}") from None
        if info.shape[-1] % block:
            raise ValueError(f"GGUF tensor {info.name!r}: row of {info.shape[-1]} is not a multiple of {block}")
        row_bytes = info.shape[-1] // block * block_bytes
        rows = prod(info.shape[:-1])
        if info.offset + rows * row_bytes > len(self._map):
            raise ValueError(f"GGUF tensor {info.name!r} extends past the end of {self.path} (truncated file?)")
        data = np.frombuffer(self._map, dtype=np.uint8, count=rows * row_bytes, offset=info.offset)
        return data.reshape(*info.shape[:-1], row_bytes)


class _Cursor:
    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer, self.pos, self.path = buffer, 0, path

    def unpack(self, fmt: str) -> Any:
        try:
            values = struct.unpack_from(fmt, self.buffer, self.pos)
        except struct.error:
            raise ValueError(f"{self.path} ends inside its GGUF header (truncated file?)") from None
        self.pos += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.unpack("<Q")
        raw = self.buffer[self.pos : self.pos + length]
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.pos += 8 + struct.unpack_from("<Q", self.buffer, self.pos)[0]

    def value(self, value_type: int, keep_strings: bool) -> Any:
        if value_type in _SCALAR:
            return self.unpack(_SCALAR[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF metadata value type {value_type}")
        item_type, count = self.unpack("<IQ")
        if item_type in _SCALAR:
            fmt = _SCALAR[item_type]
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buffer, self.pos))
            self.pos += count * struct.calcsize(fmt)
            return values
        if item_type == _STRING and keep_strings:
            return [self.string() for _ in range(count)]
        if item_type == _STRING:
            for _ in range(count):
                self.skip_string()
            return count
        return [self.value(item_type, keep_strings) for _ in range(count)]  # nested arrays


def read_gguf(path: str | Path, string_arrays: tuple[str, ...] = ()) -> GGUFFile:
    """Parse ``path``'s header; ``string_arrays`` names string-array keys to read in full."""
    path = Path(path)
    with open(path, "rb") as handle:
        buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buffer, path)
    if buffer[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    cursor.pos = 4
    version, tensor_count, kv_count = cursor.unpack("<IQQ")
    if version not in _VERSIONS:
        raise ValueError(f"{path} is GGUF version {version}; Podium reads versions {_VERSIONS}")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"), key in string_arrays)
    entries = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = cursor.unpack(f"<{cursor.unpack('<I')}Q")
        dims = (dims,) if isinstance(dims, int) else dims
        ggml_type, offset = cursor.unpack("<IQ")
        entries.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {
        name: GGUFTensorInfo(name, shape, ggml_type, data_start + offset) for name, shape, ggml_type, offset in entries
    }
    return GGUFFile(path, metadata, tensors, buffer)
