"""How a CPU worker's process keeps the memory of freed activations (glibc's malloc).

A prompt step allocates and frees megabyte-sized activations in every layer. With glibc's
default settings many of them are mapped fresh from the kernel (mmap, or the heap top
grown back after a trim) and every page is faulted in and zeroed again on first touch:
about 100k page faults per 2048-token step of the default model, a fifth of its CPU time
(docs/PERFORMANCE_CPU.md). Raising the mmap threshold to glibc's maximum and the trim
threshold well above a step's activations keeps freed blocks in the heap for the next
operator, as the caching allocators vLLM recommends on CPU (tcmalloc, jemalloc) do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import platform

logger = logging.getLogger(__name__)

# mallopt() parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2: 32 MiB on 64-bit systems.
MMAP_THRESHOLD = 32 << 20
# Free memory at the heap's top that stays mapped rather than going back to the kernel.
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Set the process's malloc thresholds (once); False where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    done = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and done
    if not done:
        logger.warning("mallopt refused the CPU worker's malloc thresholds; left as they were.")
    return done
