"""How a CPU worker's process keeps the memory of freed activations (glibc's malloc).

A prompt step allocates and frees megabyte-sized activations in every layer. With glibc's
default settings many of them are mapped fresh from the kernel (mmap, or the heap top
grown back after a trim) and every page is faulted in and zeroed again on first touch:
about 100k page faults per 2048-token step of the default model, a fifth of its CPU time
(docs/PERFORMANCE_CPU.md). Raising the mmap threshold to glibc's maximum and the trim
threshold well above a step's activations keeps freed blocks in the heap for the next
operator, as the caching allocators vLLM recommends on CPU (tcmalloc, jemalloc) do.

Memory the heap has never handed out is still faulted in by the first step that grows it:
the first prompt step at the step budget's size took 0.35-0.40 s against 0.25-0.31 s for
the next ones of that size (default model, bfloat16; 10-14k page faults against 1-2;
docs/PERFORMANCE_CPU.md, "The heap of the first full step"), the activations of a step
being larger than anything before them. `HeapReserve` faults that memory in ahead,
in pieces, for the engine core's idle time (worker/model_runner.py, `warm_up`): freed
again, it stays in the heap and the first full step's activations find it in place.

The KV cache is an anonymous mapping the kernel zeroes page by page on first use
(attention/backend.py, `zeros_on_first_touch`), so that a 4 GiB cache costs no start time.
A fresh page can cost far more than its zeroing, though: on a VM whose host hands out
memory slowly, a prompt step's K/V writes spent most of their time faulting in new pages
(docs/PERFORMANCE_CPU.md, "How much a first touch costs"). `KVCachePrefault` faults the
cache in ahead of use, block by block in the order the block pool first hands blocks out,
a time slice per call, in pieces of at most PREFAULT_PIECE_BYTES: the engine core calls it
while it has nothing to compute (core/engine_core_proc.py), so the pages are paid for in
idle time, not inside a step, and an input arriving meanwhile waits for the rest of one
slice at most.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import math
import mmap
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# mallopt() parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2: 32 MiB on 64-bit systems.
MMAP_THRESHOLD = 32 << 20
# Free memory at the heap's top that stays mapped rather than going back to the kernel.
TRIM_THRESHOLD = 1 << 30


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, loaded once for this module's calls into it."""
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


@functools.cache
def keep_freed_memory() -> bool:
    """Set the process's malloc thresholds (once); False where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = _libc()
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    done = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and done
    if not done:
        logger.warning("mallopt refused the CPU worker's malloc thresholds; left as they were.")
    return done


# madvise(2) advice (Linux 5.14 and later): fault the range's pages in as a write would,
# leaving their contents as they are.
_MADV_POPULATE_WRITE = 23


@functools.cache
def _madvise():
    if platform.system() != "Linux":
        return None
    libc = _libc()
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def populate(address: int, length: int) -> bool:
    """Fault in the pages of [address, address + length) as a write would, their contents
    unchanged (a page already in memory is left alone); False where the kernel cannot (not
    Linux, or Linux before 5.14)."""
    madvise = _madvise()
    if madvise is None:
        return False
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    end = -(-(address + length) // mmap.PAGESIZE) * mmap.PAGESIZE
    return end == start or madvise(start, end - start, _MADV_POPULATE_WRITE) == 0


# What HeapReserve takes from malloc and touches per call: below glibc's mmap threshold
# (MMAP_THRESHOLD), so that it comes from the heap and goes back to it once freed. A call
# faults in 512 pages: ~0.7 ms where fresh memory is cheap, ~25 ms where a page costs ~45 us.
HEAP_PIECE_BYTES = 2 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.cache
def _libc_heap():
    """glibc's malloc, free, sbrk and mallinfo2 (2.33 and later); None where any is missing."""
    libc = _libc()
    try:
        functions = libc.malloc, libc.free, libc.sbrk, libc.mallinfo2
    except AttributeError:
        return None
    malloc, free, sbrk, mallinfo2 = functions
    malloc.argtypes, malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    free.argtypes, free.restype = [ctypes.c_void_p], None
    sbrk.argtypes, sbrk.restype = [ctypes.c_ssize_t], ctypes.c_void_p
    mallinfo2.argtypes, mallinfo2.restype = [], _MallInfo2
    return malloc, free, sbrk, mallinfo2


class HeapReserve:
    """Faults in `nbytes` at the top of glibc's main heap ahead of the steps that will
    allocate them: a piece of HEAP_PIECE_BYTES per `step`, every piece freed again at the
    end of each call. For the thread that runs the steps when it is the process's main
    thread (its allocations come from the main heap; elsewhere it does nothing), and only
    where `keep_freed_memory()` holds, or the freed pieces go back to the kernel.

    The top, not just any free memory: a step's larger activations need contiguous blocks
    that the heap's free holes, resident already, seldom hold (a float32 model's first full
    step faulted 65 MiB in beside 140 MiB of them). So call n takes pieces until n of them
    lie at or above where the heap's top began when the reserve was made: the free holes
    first (resident; held until the end of the call, not counted), then the n - 1 pieces
    the calls before touched (freed, they joined the top and come back in the same order),
    then a new one, written once. No piece is held between calls, and the steps in between
    allocate from the same memory."""

    def __init__(self, nbytes: int) -> None:
        self.pieces = max(0, -(-nbytes // HEAP_PIECE_BYTES))
        self.done = 0
        heap = _libc_heap()
        if heap is None or threading.current_thread() is not threading.main_thread():
            self.pieces = 0
            return
        _, _, sbrk, mallinfo2 = heap
        # The top chunk's start: memory from there on may never have been touched.
        self._top = sbrk(0) - mallinfo2().keepcost

    def step(self) -> bool:
        """Fault in the next piece; whether any are left."""
        if self.done >= self.pieces:
            return False
        malloc, free, _, _ = _libc_heap()
        held, at_top = [], 0
        try:
            while at_top <= self.done:
                address = malloc(HEAP_PIECE_BYTES)
                if not address:
                    self.done = self.pieces  # out of memory: leave the rest to first use
                    return False
                held.append(address)
                at_top += address >= self._top
            ctypes.memset(held[-1], 0, HEAP_PIECE_BYTES)
        finally:
            for address in held:
                free(address)
        self.done += 1
        return self.done < self.pieces


# The most one madvise call of the idle prefault faults in: one cache's part of a few
# blocks, or of one block, cut to this size. A call costs ~0.1 ms where fresh memory is
# cheap and ~3 ms where a page costs ~45 us (docs/PERFORMANCE_CPU.md): the longest an input
# waits past the end of the engine core's time slice for it.
PREFAULT_PIECE_BYTES = 256 << 10


class KVCachePrefault:
    """Faults in the pages of a worker's KV caches ahead of their first use: blocks
    0, 1, 2, ... in turn (the block pool's free queue starts in that order, so the blocks
    handed out first are faulted in first), every cache's part of a group of blocks
    together, at most PREFAULT_PIECE_BYTES per call into the kernel.

    `caches`: contiguous CPU tensors whose dimension `block_dim` indexes the `num_blocks`
    blocks (the attention backend's layout, `kv_cache_block_dim`). Blocks already in use are
    only faulted in where they are not yet: their contents are kept. `clock`: seconds, for
    the time slices of `step` (tests pass their own)."""

    def __init__(self, caches: list[torch.Tensor], block_dim: int, num_blocks: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        # Per cache: its address, how many runs of blocks it holds (the dimensions before
        # block_dim), the bytes from one run to the next, and one block's bytes in a run.
        self._runs: list[tuple[int, int, int, int]] = []
        for cache in caches:
            if not cache.is_contiguous() or cache.shape[block_dim] != num_blocks:
                raise ValueError(f"A KV cache of shape {tuple(cache.shape)} does not hold "
                                 f"{num_blocks} blocks along dimension {block_dim}.")
            block_bytes = math.prod(cache.shape[block_dim + 1:]) * cache.element_size()
            self._runs.append((cache.data_ptr(), math.prod(cache.shape[:block_dim]),
                               num_blocks * block_bytes, block_bytes))
        self.bytes_per_block = sum(runs * block for _, runs, _, block in self._runs)
        self.num_blocks = num_blocks
        # Blocks faulted in together: as many as one piece of the largest run holds.
        largest = max((block for *_, block in self._runs), default=1)
        self.blocks_per_group = max(1, PREFAULT_PIECE_BYTES // max(largest, 1))
        self._pieces = self._ranges()
        # The first block not yet faulted in.
        self.next_block = 0 if self._runs else num_blocks
        # Time spent faulting so far: logged with the last block, for an operator to see
        # what the host charged for the cache (benchmarks/first_touch.py measures it alone).
        self.seconds = 0.0
        self._clock = clock

    def _ranges(self) -> Iterator[tuple[int, int, int, int]]:
        """(address, length, the group's first block, the first block left once this range
        is in) of every piece, in order."""
        for first in range(0, self.num_blocks, self.blocks_per_group):
            end = min(first + self.blocks_per_group, self.num_blocks)
            pieces = []
            for address, runs, run_bytes, block_bytes in self._runs:
                for run in range(runs):
                    start = address + run * run_bytes + first * block_bytes
                    stop = address + run * run_bytes + end * block_bytes
                    pieces += [(piece, min(PREFAULT_PIECE_BYTES, stop - piece))
                               for piece in range(start, stop, PREFAULT_PIECE_BYTES)]
            for index, (address, length) in enumerate(pieces):
                yield address, length, first, end if index == len(pieces) - 1 else first

    def step(self, max_seconds: float) -> bool:
        """Fault in the next pieces until `max_seconds` have passed, at least one. Returns
        whether pages are left; False also where the kernel cannot (then nothing more is
        tried: the pages are faulted in on first use, as without this)."""
        if self.next_block >= self.num_blocks:
            return False
        started = self._clock()
        for address, length, first, left in self._pieces:
            if not populate(address, length):
                error = ctypes.get_errno()
                logger.info("The KV cache is faulted in on first use from block %d on: "
                            "madvise(MADV_POPULATE_WRITE, Linux 5.14) failed (%s).",
                            first, os.strerror(error) if error else "not Linux")
                self.next_block = self.num_blocks
                return False
            self.next_block = left
            if left == self.num_blocks or self._clock() - started >= max_seconds:
                break
        self.seconds += self._clock() - started
        if self.next_block == self.num_blocks:
            gib = self.num_blocks * self.bytes_per_block / 2**30
            logger.info("The KV cache is in memory: %.2f GiB faulted in ahead of use in %.1f s "
                        "(%.2f s/GiB).", gib, self.seconds, self.seconds / gib if gib else 0.0)
        return self.next_block < self.num_blocks


# madvise(2) advice (Linux 6.1 and later): move the range onto transparent huge pages in
# place, its contents kept, whatever /sys/kernel/mm/transparent_hugepage/enabled says.
MADV_COLLAPSE = 25
# The size of a transparent huge page (2 MiB on x86-64); absent without THP support.
_HUGE_PAGE_SIZE_FILE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"


def huge_page_size() -> int | None:
    """The kernel's transparent huge page size, or None where it has none (not Linux, or
    built without THP)."""
    try:
        with open(_HUGE_PAGE_SIZE_FILE) as file:
            return int(file.read())
    except (OSError, ValueError):
        return None


def anonymous_mappings(maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """(start, end) of each of the process's private, writable mappings that no file backs
    (the heap's included), in order."""
    mappings = []
    with open(maps) as file:
        for line in file:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) > 5 else ""
            if fields[1].startswith("rw") and fields[1][3] == "p" and fields[4] == "0" and (
                    path in ("", "[heap]")):
                start, end = fields[0].split("-")
                mappings.append((int(start, 16), int(end, 16)))
    return mappings


def huge_pages_holding(spans: list[tuple[int, int]], mappings: list[tuple[int, int]],
                       page: int) -> list[int]:
    """The address of every `page`-aligned huge page that holds part of one of `spans`
    ((address, length) each) and lies wholly inside one of `mappings` ((start, end) each,
    as anonymous_mappings gives them), once each, in order."""
    pages: set[int] = set()
    for address, length in spans:
        if length <= 0:
            continue
        for start, end in mappings:
            if start < address + length and address < end:
                low = max(address // page * page, -(-start // page) * page)
                high = min(-(-(address + length) // page) * page, end // page * page)
                pages.update(range(low, high, page))
    return sorted(pages)


class WeightHugePages:
    """Moves the memory of `tensors` (what every step reads: a model's weights) onto
    transparent huge pages, one huge page per `step`: madvise(MADV_COLLAPSE), Linux 6.1 and
    later, which copies a huge page's 4 KiB pages into one and keeps their addresses and
    contents. Each huge page holding part of a tensor's storage is moved whole (what lies
    beside the tensor in it too) where it lies inside one private anonymous mapping, the
    heap included; memory a file backs, and oneDNN's opaque tensors (a float32 model's
    packed weights), are left as they are. Where the kernel refuses the first page for want
    of the call (EINVAL: before 6.1, or THP turned off for the process) nothing more is
    tried; a page refused otherwise (no huge page free: ENOMEM, EAGAIN) is left on small
    pages and the next one tried. The time taken and what moved are logged with the last
    page."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        storages = {}
        for tensor in tensors:
            # (oneDNN's opaque tensors hide their memory: they stay where they are.)
            if tensor.device.type != "cpu" or tensor.is_mkldnn:
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0:
                storages[storage.data_ptr()] = storage.nbytes()
        self.page = huge_page_size()
        self.pages: list[int] = []
        if self.page is not None and _madvise() is not None:
            self.pages = huge_pages_holding(sorted(storages.items()), anonymous_mappings(),
                                            self.page)
        self.done = 0
        self.moved = 0  # pages madvise moved (or found moved already)
        self.seconds = 0.0
        self.refusals: dict[int, int] = {}  # errno: pages refused with it

    def step(self) -> bool:
        """Move the next huge page; whether any are left."""
        if self.done >= len(self.pages):
            return False
        started = time.perf_counter()
        address = self.pages[self.done]
        self.done += 1
        if _madvise()(address, self.page, MADV_COLLAPSE) == 0:
            self.moved += 1
        else:
            error = ctypes.get_errno()
            self.refusals[error] = self.refusals.get(error, 0) + 1
            if error == errno.EINVAL and self.moved == 0:
                logger.info("The weights stay on 4 KiB pages: madvise(MADV_COLLAPSE, Linux "
                            "6.1) refused (%s).", os.strerror(error))
                self.done = len(self.pages)
                return False
        self.seconds += time.perf_counter() - started
        if self.done == len(self.pages):
            refused = ", ".join(f"{count} refused ({os.strerror(error)})"
                                for error, count in sorted(self.refusals.items()))
            logger.info("The weights are on huge pages: %d MiB moved in %.2f s%s.",
                        self.moved * self.page >> 20, self.seconds,
                        f"; {refused}" if refused else "")
        return self.done < len(self.pages)
