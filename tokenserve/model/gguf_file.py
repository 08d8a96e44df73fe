"""A GGUF file's header (metadata and tensor table) read in milliseconds, its tensors as
views of one memory map.

gguf's `GGUFReader` builds a numpy view for every string of every array (the default
model's 49k-token vocabulary and merges: ~3 s a parse). tokenserve needs the scalar
metadata and the tensor table only, so string arrays are skipped over by their lengths and
kept as a count; the tokenizer conversion, which needs the strings, goes through
transformers and is cached (gguf_loader.py). Little-endian GGUF v2 / v3, as llama.cpp
writes it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Fixed-size metadata value types: struct format, numpy dtype.
_SCALARS: dict[GGUFValueType, tuple[str, type]] = {
    GGUFValueType.UINT8: ("<B", np.uint8),
    GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16),
    GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32),
    GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32),
    GGUFValueType.BOOL: ("<?", np.bool_),
    GGUFValueType.UINT64: ("<Q", np.uint64),
    GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
}
# Tensor types stored as plain numbers rather than blocks.
_PLAIN_TENSOR_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings, skipped when reading the header: only its length."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the table, its bytes read only through `data`."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # innermost dimension first, as GGUF lists them
    n_bytes: int
    data_offset: int  # from the start of the file
    _buffer: mmap.mmap

    @property
    def data(self) -> np.ndarray:
        """A read-only view of the mapped file, shaped as gguf's reader shapes it: numbers for
        plain types, `[..., bytes of a row's blocks]` uint8 for block types."""
        dims = tuple(reversed(self.shape))
        plain = _PLAIN_TENSOR_TYPES.get(self.tensor_type)
        if plain is None:
            dtype, dims = np.dtype(np.uint8), quant_shape_to_byte_shape(dims, self.tensor_type)
        else:
            dtype = np.dtype(plain)
        count = self.n_bytes // dtype.itemsize
        return np.frombuffer(self._buffer, dtype, count, self.data_offset).reshape(dims)


class GGUFFile:
    """The header of a GGUF file: `metadata` (key → value; a string array is a StringArray,
    a numeric one a numpy array) and `tensors` in file order. ValueError (naming the file)
    for anything that is not a readable, complete GGUF file."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as file:
            try:
                self._buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise ValueError(f"GGUF file {path} is empty.") from None
        self._offset = 0
        try:
            self.metadata, self.tensors = self._read_header()
        except (struct.error, UnicodeDecodeError, OverflowError) as error:
            raise ValueError(f"GGUF file {path} is corrupt or truncated: {error}") from error
        for tensor in self.tensors:
            if tensor.data_offset + tensor.n_bytes > len(self._buffer):
                raise ValueError(
                    f"GGUF file {path} is truncated: tensor {tensor.name!r} ends past the end "
                    f"of the file ({len(self._buffer)} bytes)."
                )

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def _read_header(self) -> tuple[dict[str, Any], list[GGUFTensor]]:
        if self._read_bytes(4) != GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic number).")
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(
                f"GGUF file {self.path} has version {version}; tokenserve reads little-endian "
                "GGUF versions 2 and 3."
            )
        num_tensors, num_fields = self._unpack("<Q"), self._unpack("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._read_string()
            if key in metadata:
                raise ValueError(f"GGUF file {self.path} repeats the metadata key {key!r}.")
            metadata[key] = self._read_value(GGUFValueType(self._unpack("<I")))
        infos = []
        for _ in range(num_tensors):
            name = self._read_string()
            shape = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            tensor_type = GGMLQuantizationType(self._unpack("<I"))
            infos.append((name, shape, tensor_type, self._unpack("<Q")))
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._offset // alignment) * alignment
        self.header_size = data_start  # metadata and tensor table: the file's identity
        tensors = []
        for name, shape, tensor_type, offset in infos:
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
            n_bytes = int(np.prod(shape, dtype=np.int64)) * type_size // block_size
            tensors.append(
                GGUFTensor(name, tensor_type, shape, n_bytes, data_start + offset, self._buffer)
            )
        if len({tensor.name for tensor in tensors}) != len(tensors):
            raise ValueError(f"GGUF file {self.path} names a tensor twice.")
        return metadata, tensors

    def _read_value(self, value_type: GGUFValueType) -> Any:
        if value_type == GGUFValueType.STRING:
            return self._read_string()
        if value_type != GGUFValueType.ARRAY:
            return self._unpack(_SCALARS[value_type][0])
        item_type = GGUFValueType(self._unpack("<I"))
        count = self._unpack("<Q")
        if item_type == GGUFValueType.STRING:
            for _ in range(count):  # skipped: only the tokenizer conversion reads them
                length = self._unpack("<Q")
                self._offset += length
            return StringArray(count)
        if item_type == GGUFValueType.ARRAY:
            return [self._read_value(GGUFValueType.ARRAY) for _ in range(count)]
        dtype = np.dtype(_SCALARS[item_type][1]).newbyteorder("<")
        values = np.frombuffer(self._read_bytes(count * dtype.itemsize), dtype)
        return values

    def _read_string(self) -> str:
        return self._read_bytes(self._unpack("<Q")).decode("utf-8")

    def _read_bytes(self, count: int) -> bytes:
        end = self._offset + count
        if end > len(self._buffer):
            raise struct.error(f"needs {count} bytes at offset {self._offset}, past the end")
        data = self._buffer[self._offset : end]
        self._offset = end
        return data

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buffer, self._offset)
        self._offset += struct.calcsize(fmt)
        return value
