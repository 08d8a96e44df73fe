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
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32


# The format's codes, as gguf's `GGUFValueType` and `GGML_QUANT_SIZES` give them: kept here
# because importing gguf (~0.1 s, its tables of every architecture's tensor names) would be
# on the engine process's start, which reads a header and no tensor (tests compare them).
class ValueType(IntEnum):
    """A metadata value's type."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# Fixed-size metadata value types: struct format, numpy dtype.
_SCALARS: dict[ValueType, tuple[str, type]] = {
    ValueType.UINT8: ("<B", np.uint8),
    ValueType.INT8: ("<b", np.int8),
    ValueType.UINT16: ("<H", np.uint16),
    ValueType.INT16: ("<h", np.int16),
    ValueType.UINT32: ("<I", np.uint32),
    ValueType.INT32: ("<i", np.int32),
    ValueType.FLOAT32: ("<f", np.float32),
    ValueType.BOOL: ("<?", np.bool_),
    ValueType.UINT64: ("<Q", np.uint64),
    ValueType.INT64: ("<q", np.int64),
    ValueType.FLOAT64: ("<d", np.float64),
}
# Tensor type code → (values per block, bytes per block) for the common types; any other
# type's come from gguf's table.
_TYPE_SIZES = {
    0: (1, 4), 1: (1, 2), 30: (1, 2), 28: (1, 8),  # F32, F16, BF16, F64
    24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8),  # I8, I16, I32, I64
    2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),  # Q4_0 ... Q8_0
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),  # Q2_K-Q6_K
}
# Tensor types stored as plain numbers rather than blocks (BF16, which numpy lacks, is read
# as blocks of bytes, as gguf's reader does).
_PLAIN_TENSOR_TYPES = {
    0: np.float32, 1: np.float16, 28: np.float64,
    24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
}


def _type_sizes(type_code: int) -> tuple[int, int]:
    sizes = _TYPE_SIZES.get(type_code)
    if sizes is None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        sizes = GGML_QUANT_SIZES[GGMLQuantizationType(type_code)]
    return sizes


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
    type_code: int  # the format's number for its type: `tensor_type` names it
    shape: tuple[int, ...]  # innermost dimension first, as GGUF lists them
    n_bytes: int
    data_offset: int  # from the start of the file
    _buffer: mmap.mmap

    @property
    def tensor_type(self) -> GGMLQuantizationType:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.type_code)

    @property
    def data(self) -> np.ndarray:
        """A read-only view of the mapped file, shaped as gguf's reader shapes it: numbers for
        plain types, `[..., bytes of a row's blocks]` uint8 for block types."""
        dims = tuple(reversed(self.shape))
        plain = _PLAIN_TENSOR_TYPES.get(self.type_code)
        if plain is None:
            block_size, type_size = _type_sizes(self.type_code)
            if dims[-1] % block_size:
                raise ValueError(
                    f"Tensor {self.name!r}: its rows of {dims[-1]} values are not whole blocks "
                    f"of {block_size} ({self.tensor_type.name})."
                )
            dtype, dims = np.dtype(np.uint8), (*dims[:-1], dims[-1] // block_size * type_size)
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
            metadata[key] = self._read_value(ValueType(self._unpack("<I")))
        infos = []
        for _ in range(num_tensors):
            name = self._read_string()
            shape = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            infos.append((name, shape, self._unpack("<I"), self._unpack("<Q")))
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._offset // alignment) * alignment
        self.header_size = data_start  # metadata and tensor table: the file's identity
        tensors = []
        for name, shape, type_code, offset in infos:
            block_size, type_size = _type_sizes(type_code)
            n_bytes = int(np.prod(shape, dtype=np.int64)) * type_size // block_size
            tensors.append(
                GGUFTensor(name, type_code, shape, n_bytes, data_start + offset, self._buffer)
            )
        if len({tensor.name for tensor in tensors}) != len(tensors):
            raise ValueError(f"GGUF file {self.path} names a tensor twice.")
        return metadata, tensors

    def _read_value(self, value_type: ValueType) -> Any:
        if value_type == ValueType.STRING:
            return self._read_string()
        if value_type != ValueType.ARRAY:
            return self._unpack(_SCALARS[value_type][0])
        item_type = ValueType(self._unpack("<I"))
        count = self._unpack("<Q")
        if item_type == ValueType.STRING:
            for _ in range(count):  # skipped: only the tokenizer conversion reads them
                length = self._unpack("<Q")
                self._offset += length
            return StringArray(count)
        if item_type == ValueType.ARRAY:
            return [self._read_value(ValueType.ARRAY) for _ in range(count)]
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
