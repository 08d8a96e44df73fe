"""A GGUF model's expanded weights, kept on disk and memory-mapped at the next start.

Expanding a GGUF file (gguf's numpy dequantization, the q/k row order undone, the Q4_1 /
Q8_0 blocks repacked) takes most of a model load on CPU, and gives the same tensors every
time. The first load writes what it yields into one file under `weights/` of the cache
directory (`cache_dir.py`); later loads map that file (private, copy-on-write) and yield
views of it, which the parameters keep as their memory instead of copies
(layers/weight_loading.py): a merged parameter's parts (a layer's q, k and v) are written
side by side for that. Each dense weight is stored in the dtype of the parameter it fills
(`WeightDtypes`: bfloat16 for a bf16 model's projections), so a bf16 entry is smaller and
loading it copies instead of casting; the copy into a bf16 parameter rounds the same way
either way. An entry is keyed by the GGUF file's identity (size, mtime, SHA-256 of its
header), those dtypes and the code that expands it (this package's expansion sources,
gguf's and numpy's versions), so a changed file, dtype or expansion gets a new entry.
It is written under a temporary name and renamed into place, so a reader never sees a
partial entry; every array carries a checksum that is verified before any tensor of the
entry is yielded, so a damaged entry is removed and rebuilt, never served. Writing an
entry prunes the same model file's least recently used ones (`weight_cache_pruning.py`).

File layout: the arrays (each 64-byte aligned), then a JSON index, then the index's length
(u64, little-endian) and the magic number.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
import torch

from tokenserve.cache_dir import cache_root
from tokenserve.model.layers.quantization.gguf import QuantizedWeight
from tokenserve.model.layers.weight_loading import mark_aliasable
from tokenserve.model.weight_cache_pruning import mark_used, prune

logger = logging.getLogger(__name__)

MAGIC = b"TSWCACH2"
_TRAILER = struct.Struct("<Q8s")  # index length, magic
_ALIGNMENT = 64
# The order of the arrays in an entry, part of its key: 2, a merged parameter's parts side
# by side (`_packed_together`).
_LAYOUT = 2
# What the entries hold: the parameters' float dtypes and the blocks' uint8 / int8 ones.
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "uint8": torch.uint8, "int8": torch.int8}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_DENSE = "dense"
# The sources (in this package) whose code decides the expanded tensors.
_EXPANSION_SOURCES = ("gguf_loader.py", "gguf_file.py", os.path.join("layers", "quantization", "gguf.py"))

Weight = tuple[str, "torch.Tensor | QuantizedWeight"]


class CorruptCacheEntry(ValueError):
    """A cache entry that is not what its writer wrote: truncated, damaged or foreign."""


@dataclass(frozen=True)
class WeightDtypes:
    """The dtype of each parameter a checkpoint's dense weights go into, so that the cache
    stores them in it. `params`: parameter name (a layer's index as "*") → dtype, only
    those not float32; `packed`: a checkpoint name's part → its merged parameter's part
    (q_proj → qkv_proj: the model's `packed_modules_mapping`). A weight whose parameter is
    not found stays float32 (the loader then converts it, as without the cache)."""

    params: dict[str, torch.dtype] = field(default_factory=dict)
    packed: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, model: torch.nn.Module) -> WeightDtypes:
        params = {_any_layer(name): param.dtype for name, param in model.named_parameters()
                  if param.dtype != torch.float32 and param.dtype.is_floating_point}
        packed = {part: merged for part, (merged, _) in
                  getattr(model, "packed_modules_mapping", {}).items()}
        return cls(params, packed)

    def dtype_for(self, name: str) -> torch.dtype:
        """The dtype the checkpoint's dense weight `name` is stored in."""
        return self.params.get(_merged_name(_any_layer(name), self.packed)[0], torch.float32)

    def key(self) -> str:
        """What the entry's key says of these dtypes ("" when nothing is converted)."""
        if not self.params:
            return ""
        return json.dumps([sorted((n, str(d)) for n, d in self.params.items()),
                           sorted(self.packed.items())])


def _any_layer(name: str) -> str:
    """`name` with its layer index as "*": every layer's parameters alike, on every
    pipeline stage."""
    return _LAYER_INDEX.sub(".*.", name)


_LAYER_INDEX = re.compile(r"\.\d+\.")


def cached_gguf_weights(
    path: str,
    header_size: int,
    expand: Callable[[], Iterable[Weight]],
    dtypes: WeightDtypes | None = None,
) -> Iterator[Weight]:
    """The weights `expand()` yields for the GGUF file at `path` (whose header is its first
    `header_size` bytes), each dense one in `dtypes`' dtype for it (default float32), from
    the cache when it holds them, else expanded and cached."""
    dtypes = dtypes or WeightDtypes()
    entry = entry_path(path, header_size, dtypes)
    if os.path.exists(entry):
        try:
            weights = read_entry(entry, dtypes.packed)
        except (CorruptCacheEntry, OSError) as error:
            logger.warning("Rebuilding the weight cache entry %s: %s", entry, error)
            _remove(entry)
        else:
            logger.info("Weights from the cache: %s.", entry)
            mark_used(entry)
            yield from weights
            return
    yield from _expand_and_write(_packed_together(_stored(expand(), dtypes), dtypes.packed), entry)


def _stored(weights: Iterable[Weight], dtypes: WeightDtypes) -> Iterator[Weight]:
    """The expanded weights in the dtypes they are stored in (the expansion's float32 where
    the parameter is float32 or not known)."""
    for name, weight in weights:
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32:
            dtype = dtypes.dtype_for(name)
            if dtype != torch.float32:
                weight = weight.to(dtype)
        yield name, weight


def _packed_together(weights: Iterable[Weight], packed: dict[str, str]) -> Iterator[Weight]:
    """The weights with the dense parts of each merged parameter (a layer's q, k and v) one
    after another, in the order `packed` lists the parts (the merged parameter's rows), so
    that the entry holds them in one run of memory the parameter can keep as its own
    (layers/weight_loading.py). A part waits for the rest of its parameter; the expansion
    yields a layer's weights together, so little waits at once."""
    parts_of: dict[str, list[str]] = {}
    for part, merged in packed.items():
        parts_of.setdefault(merged, []).append(part)
    waiting: dict[str, dict[str, Weight]] = {}  # merged name -> part -> weight
    for name, weight in weights:
        key, part = _merged_name(name, packed)
        if part is None or not isinstance(weight, torch.Tensor):
            yield name, weight
            continue
        merged = packed[part]
        group = waiting.setdefault(key, {})
        group[part] = (name, weight)
        if len(group) == len(parts_of[merged]):
            yield from (group[part] for part in parts_of[merged])
            del waiting[key]
    for group in waiting.values():  # a checkpoint without every part: as they came
        yield from group.values()


def entry_path(path: str, header_size: int, dtypes: WeightDtypes | None = None) -> str:
    """Where the cached weights of the GGUF file at `path` live: a name per model file (its
    real path) and key, so that pruning finds the file's other entries."""
    stat = os.stat(path)
    with open(path, "rb") as file:
        header_digest = hashlib.sha256(file.read(header_size)).hexdigest()
    key = "|".join((str(stat.st_size), str(stat.st_mtime_ns), header_digest,
                    (dtypes or WeightDtypes()).key(), code_version()))
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    stem = os.path.splitext(os.path.basename(path))[0]
    file_id = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:8]
    return os.path.join(cache_root(), "weights", f"{stem}-{file_id}-{digest}.bin")


def code_version() -> str:
    """A digest of what decides the expanded tensors and their layout: the sources that
    expand them, the versions of gguf and numpy, which dequantize, and the entry's order."""
    from importlib.metadata import version

    digest = hashlib.sha256(
        f"{MAGIC!r}|{_LAYOUT}|{version('gguf')}|{np.__version__}".encode())
    for source in _EXPANSION_SOURCES:
        with open(os.path.join(os.path.dirname(__file__), source), "rb") as file:
            digest.update(file.read())
    return digest.hexdigest()[:16]


def read_entry(entry: str, packed: dict[str, str] | None = None) -> list[Weight]:
    """Every weight of a cache entry, as views of private mappings of it; CorruptCacheEntry
    if any array does not match its checksum or the layout does not hold together. Each
    parameter's dense weights (a merged one's parts together, as `packed` names them: a
    checkpoint name's part -> its merged parameter's part) are views of a mapping of their
    own, which the parameter may keep as its memory (layers/weight_loading.py) and which
    goes when the parameter lets go of it (a dense weight freed once packed); the other
    forms (GGUF blocks, which the load joins into fresh memory) of one more mapping."""
    with open(entry, "rb") as file:
        try:
            whole_file = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        except ValueError:
            raise CorruptCacheEntry("empty file") from None
        size = len(whole_file)
        if size < _TRAILER.size:
            raise CorruptCacheEntry("shorter than its trailer")
        index_size, magic = _TRAILER.unpack_from(whole_file, size - _TRAILER.size)
        index_start = size - _TRAILER.size - index_size
        if magic != MAGIC or index_start < 0:
            raise CorruptCacheEntry("no trailer (an older format, or truncated)")
        try:
            items = json.loads(bytes(whole_file[index_start : size - _TRAILER.size]))["weights"]
            mappings = _dense_mappings(file, items, packed or {}, index_start)
            other = _Mapping(whole_file, 0)
            return [_weight(item, mappings.get(position, other), index_start)
                    for position, item in enumerate(items)]
        except (KeyError, TypeError, ValueError) as error:
            raise CorruptCacheEntry(f"unreadable index or data: {error}") from error


class _Mapping:
    """A private mapping of part of an entry, from file offset `start`, and a uint8 tensor
    over all of it: the arrays in it are views of that one tensor, so that arrays written
    one after another lie one after another in one storage (a merged parameter's parts)."""

    def __init__(self, buffer: mmap.mmap, start: int) -> None:
        self.buffer, self.start = buffer, start
        self.tensor = torch.frombuffer(buffer, dtype=torch.uint8)


def _dense_mappings(file: BinaryIO, items: list[dict[str, Any]], packed: dict[str, str],
                    data_end: int) -> dict[int, _Mapping]:
    """A mapping per parameter's dense weights (by the position of each in `items`), over
    the span of their arrays."""
    groups: dict[str, list[int]] = {}
    for position, item in enumerate(items):
        if item["form"] == _DENSE:
            groups.setdefault(_merged_name(item["name"], packed)[0], []).append(position)
    mappings = {}
    for positions in groups.values():
        spans = [(int(spec["offset"]), int(spec["nbytes"]))
                 for position in positions for spec in items[position]["arrays"]]
        for offset, nbytes in spans:
            if offset < 0 or offset % _ALIGNMENT or nbytes < 0 or offset + nbytes > data_end:
                raise CorruptCacheEntry(f"an array at {offset} (+{nbytes}) outside the data")
        start = min(offset for offset, _ in spans) // mmap.ALLOCATIONGRANULARITY * (
            mmap.ALLOCATIONGRANULARITY)
        end = max(offset + nbytes for offset, nbytes in spans)
        if end == start:
            continue  # empty arrays: nothing to map
        mapping = _Mapping(mmap.mmap(file.fileno(), end - start, access=mmap.ACCESS_COPY,
                                     offset=start), start)
        mappings.update((position, mapping) for position in positions)
    return mappings


def _merged_name(name: str, packed: dict[str, str]) -> tuple[str, str | None]:
    """The name of the parameter a checkpoint weight goes into, and the weight's part of it
    (None: the whole)."""
    for part, merged in packed.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{merged}."), part
    return name, None


def _weight(item: dict[str, Any], mapping: _Mapping, data_end: int) -> Weight:
    arrays = [_array(spec, mapping, data_end) for spec in item["arrays"]]
    if item["form"] == _DENSE:
        [tensor] = arrays
        # A parameter may keep the mapping's memory (layers/weight_loading.py): the mapping
        # is private, and an entry is replaced by a rename, never rewritten.
        return item["name"], mark_aliasable(tensor)
    qs, scales = arrays
    return item["name"], QuantizedWeight(item["form"], qs, scales)


def _array(spec: dict[str, Any], mapping: _Mapping, data_end: int) -> torch.Tensor:
    offset, nbytes = int(spec["offset"]), int(spec["nbytes"])
    if offset < 0 or offset % _ALIGNMENT or offset + nbytes > data_end:
        raise CorruptCacheEntry(f"an array at {offset} (+{nbytes}) outside the data")
    position = offset - mapping.start
    data = np.frombuffer(mapping.buffer, np.uint8, nbytes, position)
    if checksum(data) != spec["checksum"]:
        raise CorruptCacheEntry(f"the array at {offset} does not match its checksum")
    dtype = _DTYPES[spec["dtype"]]
    shape = [int(dim) for dim in spec["shape"]]
    count = nbytes // dtype.itemsize
    if count != int(np.prod(shape, dtype=np.int64)):
        raise CorruptCacheEntry(f"the array at {offset} does not fill its shape {shape}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return mapping.tensor.narrow(0, position, nbytes).view(dtype).view(shape)


def checksum(data: np.ndarray) -> int:
    """The sum of the bytes read as little-endian u64 words (the tail zero-padded), modulo
    2**64: one fast pass that catches truncation, zeroed pages and overwritten data."""
    whole = len(data) // 8 * 8
    total = int(data[:whole].view("<u8").sum(dtype=np.uint64)) if whole else 0
    tail = data[whole:].tobytes()
    if tail:
        total += int.from_bytes(tail.ljust(8, b"\0"), "little")
    return total % 2**64


def _expand_and_write(weights: Iterable[Weight], entry: str) -> Iterator[Weight]:
    """Yield `weights`, writing each into a temporary file renamed to `entry` at the end."""
    writer = _EntryWriter.open(entry)
    if writer is None:
        yield from weights
        return
    try:
        for name, weight in weights:
            writer.add(name, weight)
            yield name, weight
        writer.commit()
    finally:
        writer.discard()  # a no-op once committed


class _EntryWriter:
    def __init__(self, entry: str, file: BinaryIO, temporary: str) -> None:
        self.entry, self.file, self.temporary = entry, file, temporary
        self.index: list[dict[str, Any]] = []
        self.failed = False
        self.committed = False

    @classmethod
    def open(cls, entry: str) -> _EntryWriter | None:
        try:
            os.makedirs(os.path.dirname(entry), exist_ok=True)
            descriptor, temporary = tempfile.mkstemp(prefix=".partial-", dir=os.path.dirname(entry))
        except OSError as error:
            logger.warning("Not caching the expanded weights in %s: %s", entry, error)
            return None
        return cls(entry, os.fdopen(descriptor, "wb"), temporary)

    def add(self, name: str, weight: torch.Tensor | QuantizedWeight) -> None:
        if self.failed:
            return
        if isinstance(weight, QuantizedWeight):
            form, tensors = weight.kind, [weight.qs, weight.scales]
        else:
            form, tensors = _DENSE, [weight]
        try:
            arrays = [self._write(tensor) for tensor in tensors]
        except (OSError, KeyError) as error:  # a full disk, or a dtype the format lacks
            logger.warning("Not caching the expanded weights in %s: %s", self.entry, error)
            self.failed = True
            return
        self.index.append({"name": name, "form": form, "arrays": arrays})

    def _write(self, tensor: torch.Tensor) -> dict[str, Any]:
        dtype = _DTYPE_NAMES[tensor.dtype]
        offset = self.file.tell()
        # Bytes through torch: numpy has no bfloat16.
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self.file.write(data.data)
        self.file.write(b"\0" * (-self.file.tell() % _ALIGNMENT))
        return {"dtype": dtype, "shape": list(tensor.shape), "offset": offset,
                "nbytes": data.nbytes, "checksum": checksum(data)}

    def commit(self) -> None:
        if self.failed:
            return
        try:
            index = json.dumps({"weights": self.index}).encode()
            self.file.write(index)
            self.file.write(_TRAILER.pack(len(index), MAGIC))
            self.file.close()
            os.replace(self.temporary, self.entry)  # readers see the whole entry or none
        except OSError as error:
            logger.warning("Not caching the expanded weights in %s: %s", self.entry, error)
            return
        self.committed = True
        logger.info("Expanded weights cached in %s.", self.entry)
        prune(self.entry)

    def discard(self) -> None:
        if self.committed:
            return
        self.file.close()
        _remove(self.temporary)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
