"""The CPU worker's malloc thresholds (worker/cpu_memory.py): freed activation-sized blocks
are reused from the heap instead of being mapped, faulted in and zeroed again."""

from __future__ import annotations

import platform
import subprocess
import sys
from types import SimpleNamespace

import pytest

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


def test_the_worker_sets_them_on_cpu(monkeypatch):
    from tokenserve.worker import worker

    calls = []
    monkeypatch.setattr(worker, "keep_freed_memory", lambda: calls.append(True))
    monkeypatch.setattr(worker, "init_model_parallel", lambda *args: None)
    monkeypatch.setattr(worker, "ModelRunner", lambda *args: None)
    worker.Worker(config=SimpleNamespace(parallel_config=None))
    assert calls == [True]
