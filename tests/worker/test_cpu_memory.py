"""The CPU worker's memory (worker/cpu_memory.py): freed activation-sized blocks are reused
from the heap instead of being mapped, faulted in and zeroed again; the heap a full step takes
and the KV cache's pages are faulted in ahead of use, the cache's lowest block first, its
contents kept."""

from __future__ import annotations

import mmap
import platform
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.memory_pages import cpu_memory_log_lines, needs_populate, resident_pages
from tokenserve.attention.backend import zeros_on_first_touch
from tokenserve.worker.cpu_memory import KVCachePrefault

# A step's worth of 4 MiB activations allocated, written and freed, three times; prints the
# page faults of the last two rounds (the first one maps the heap either way).
_ROUNDS = """
import ctypes, ctypes.util, resource, sys
if sys.argv[1] == "set":
    from tokenserve.worker.cpu_memory import keep_freed_memory
    assert keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def one_round(size=4 << 20):
    blocks = [libc.malloc(size) for _ in range(16)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in reversed(blocks):
        libc.free(block)
one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
one_round()
one_round()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, check=True
    )
    return int(done.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_freed_blocks_are_reused_without_page_faults():
    # 2 rounds x 16 blocks x 1024 pages are faulted in again by default; none once set.
    assert _page_faults("default") > 16 * 1024
    assert _page_faults("set") < 1024


# A step's activations, 12 blocks of 4 MiB allocated, written and freed, after a HeapReserve
# of argv[1] bytes (0: none) worked through to its end; prints the page faults of the step.
_FIRST_STEP = """
import ctypes, ctypes.util, resource, sys
from tokenserve.worker.cpu_memory import HEAP_PIECE_BYTES, HeapReserve, keep_freed_memory
assert keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
reserve = HeapReserve(int(sys.argv[1]))
calls = 1
while reserve.step():
    calls += 1
assert calls == max(1, reserve.pieces), (calls, reserve.pieces)
assert reserve.pieces * HEAP_PIECE_BYTES == int(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
blocks = [libc.malloc(4 << 20) for _ in range(12)]
for block in blocks:
    ctypes.memset(block, 1, 4 << 20)
for block in reversed(blocks):
    libc.free(block)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _first_step_page_faults(reserve_bytes: int) -> int:
    done = subprocess.run([sys.executable, "-c", _FIRST_STEP, str(reserve_bytes)],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_a_heap_reserve_faults_a_steps_memory_in_ahead_of_it():
    # 48 MiB: 12,288 pages, faulted in by the step itself but for what the heap's top held
    # already (a few pages); with 64 MiB reserved (32 pieces of 2 MiB, none of them held
    # afterwards) the step finds them in place.
    assert _first_step_page_faults(0) > 11 * 1024
    assert _first_step_page_faults(64 << 20) < 1024


def test_the_worker_sets_them_on_cpu(monkeypatch):
    from tokenserve.worker import worker

    calls = []
    monkeypatch.setattr(worker, "keep_freed_memory", lambda: calls.append(True))
    monkeypatch.setattr(worker, "init_model_parallel", lambda *args: None)
    monkeypatch.setattr(worker, "ModelRunner", lambda *args: None)
    worker.Worker(config=SimpleNamespace(parallel_config=None))
    assert calls == [True]


# ------------------------------------------------------------------ KV cache prefault

def _ticking_clock(monkeypatch) -> SimpleNamespace:
    """A clock for KVCachePrefault that advances one second per call into the kernel."""
    from tokenserve.worker import cpu_memory

    clock = SimpleNamespace(now=0.0, ranges=[])
    populate = cpu_memory.populate

    def ticking(address: int, length: int) -> bool:
        clock.now += 1.0
        clock.ranges.append((address, length))
        return populate(address, length)

    monkeypatch.setattr(cpu_memory, "populate", ticking)
    return clock


@needs_populate
def test_prefault_faults_blocks_in_lowest_first_and_keeps_their_contents(monkeypatch):
    from tokenserve.worker import cpu_memory

    # Two layers' caches as the CPU backend lays them out: [2 (K, V), blocks, ...]; a block
    # of one half is 4 pages, and a piece two blocks of one half.
    num_blocks, block_pages = 6, 4
    block_bytes = block_pages * mmap.PAGESIZE
    monkeypatch.setattr(cpu_memory, "PREFAULT_PIECE_BYTES", 2 * block_bytes)
    shape = (2, num_blocks, block_bytes // 4)
    caches = [zeros_on_first_touch(shape, torch.float32, torch.device("cpu")) for _ in range(2)]
    for cache in caches:
        assert not any(resident_pages(cache))
    caches[1][1, 4, 7] = 3.5  # a block in use already (its value page is in memory)

    clock = _ticking_clock(monkeypatch)
    prefault = KVCachePrefault(caches, block_dim=1, num_blocks=num_blocks,
                               clock=lambda: clock.now)
    assert prefault.bytes_per_block == 2 * 2 * block_bytes
    assert prefault.blocks_per_group == 2

    def resident_blocks(cache, half):
        pages = resident_pages(cache[half])
        return [all(pages[b * block_pages:(b + 1) * block_pages]) for b in range(num_blocks)]

    # Pieces until the slice is used up: four (every cache's K and V part of blocks 0-1).
    assert prefault.step(4.0)
    assert prefault.next_block == 2
    for cache in caches:
        for half in (0, 1):
            assert resident_blocks(cache, half)[:2] == [True, True]
            assert not any(resident_blocks(cache, half)[2:4])
    # One piece, the first cache's keys of blocks 2-3: the group is not in yet. A slice of
    # no time still takes one piece.
    assert prefault.step(1.0)
    assert resident_blocks(caches[0], 0)[2:4] == [True, True]
    assert not any(resident_blocks(caches[0], 1)[2:4])
    assert prefault.next_block == 2
    assert prefault.step(0.0)
    assert resident_blocks(caches[0], 1)[2:4] == [True, True]
    # The last call says nothing is left, and logs what the whole cache took, once.
    with cpu_memory_log_lines(monkeypatch) as lines:
        assert not prefault.step(100.0)
        assert not prefault.step(100.0)
    assert len(clock.ranges) == 3 * 4  # 3 groups, 4 pieces each: one call each
    assert all(length == 2 * block_bytes for _, length in clock.ranges)
    assert prefault.seconds == 12.0
    gib = num_blocks * prefault.bytes_per_block / 2**30
    [line] = lines
    assert line.startswith(f"The KV cache is in memory: {gib:.2f} GiB faulted in ahead of use "
                           f"in 12.0 s"), line
    for cache in caches:
        assert all(resident_pages(cache))
    # Contents unchanged: zeros, and the value written before.
    assert caches[1][1, 4, 7].item() == 3.5
    caches[1][1, 4, 7] = 0.0
    assert all(not cache.any() for cache in caches)


@needs_populate
def test_prefault_cuts_a_block_larger_than_a_piece(monkeypatch):
    from tokenserve.worker import cpu_memory

    # One cache, a block of one half 4 pages, a piece 1 page: a block takes 8 calls.
    monkeypatch.setattr(cpu_memory, "PREFAULT_PIECE_BYTES", mmap.PAGESIZE)
    cache = zeros_on_first_touch((2, 3, mmap.PAGESIZE), torch.float32, torch.device("cpu"))
    clock = _ticking_clock(monkeypatch)
    prefault = KVCachePrefault([cache], block_dim=1, num_blocks=3, clock=lambda: clock.now)
    assert prefault.blocks_per_group == 1
    assert prefault.step(0.0)
    assert resident_pages(cache[0]) == [True] + [False] * 11
    assert prefault.step(6.0)  # the rest of block 0's keys, and its values
    assert prefault.next_block == 0
    assert prefault.step(1.0)
    assert prefault.next_block == 1
    assert resident_pages(cache[0])[:5] == [True] * 4 + [False]
    assert resident_pages(cache[1])[:5] == [True] * 4 + [False]
    assert not prefault.step(100.0) and all(resident_pages(cache))
    assert all(length == mmap.PAGESIZE for _, length in clock.ranges)
    assert len(clock.ranges) == 3 * 2 * 4


def test_prefault_refuses_a_layout_without_the_blocks():
    with pytest.raises(ValueError, match="does not hold 8 blocks along dimension 1"):
        KVCachePrefault([torch.zeros(2, 4, 16)], block_dim=1, num_blocks=8)
    # No caches (an encoder-only model): nothing to do.
    assert not KVCachePrefault([], block_dim=1, num_blocks=8).step(1.0)


def test_prefault_gives_up_where_the_kernel_cannot(monkeypatch):
    from tokenserve.worker import cpu_memory

    attempts = []
    monkeypatch.setattr(cpu_memory, "populate", lambda *range_: attempts.append(range_) and False)
    with cpu_memory_log_lines(monkeypatch) as lines:
        prefault = KVCachePrefault([torch.zeros(2, 4, 1024)], block_dim=1, num_blocks=4)
        assert not prefault.step(1.0)
    [line] = lines
    assert "faulted in on first use from block 0 on" in line
    # Nothing more is tried.
    assert not prefault.step(1.0) and len(attempts) == 1
