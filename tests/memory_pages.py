"""Which pages of a tensor's memory are resident (mincore(2)), for the tests of faulting the
KV cache in ahead of use (worker/cpu_memory.py), and whether this kernel can do that."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import platform

import pytest
import torch

from tokenserve.worker.cpu_memory import populate


def resident_pages(tensor: torch.Tensor) -> list[bool]:
    """Per page of the tensor's memory (page-aligned, whole pages), whether it is in memory."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = tensor.data_ptr()
    length = tensor.numel() * tensor.element_size()
    assert start % mmap.PAGESIZE == 0 and length % mmap.PAGESIZE == 0
    flags = ctypes.create_string_buffer(length // mmap.PAGESIZE)
    assert libc.mincore(start, length, flags) == 0, ctypes.get_errno()
    return [byte & 1 == 1 for byte in flags.raw]


def _can_populate() -> bool:
    probe = torch.zeros(1)  # memory already in use: populating it changes nothing
    return populate(probe.data_ptr(), probe.element_size())


needs_populate = pytest.mark.skipif(
    platform.system() != "Linux" or not _can_populate(),
    reason="madvise(MADV_POPULATE_WRITE): Linux 5.14 and later",
)
