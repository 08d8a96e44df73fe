"""Which pages of a tensor's memory are resident (mincore(2)) or huge, for the tests of
faulting the KV cache in ahead of use and of moving weights onto huge pages
(worker/cpu_memory.py), and whether this kernel can do those."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import mmap
import platform
from collections.abc import Iterator

import pytest
import torch

from tokenserve.worker import cpu_memory
from tokenserve.worker.cpu_memory import MADV_COLLAPSE, huge_page_size, populate


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


def _can_collapse() -> bool:
    """Whether madvise(MADV_COLLAPSE) moves a page of written memory onto a huge page here."""
    page, madvise = huge_page_size(), cpu_memory._madvise()  # the call WeightHugePages makes
    if page is None or madvise is None:
        return False
    region = mmap.mmap(-1, 2 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = (ctypes.c_char * len(region)).from_buffer(region)
    address = -(-ctypes.addressof(buffer) // page) * page  # the huge page inside it
    ctypes.memset(address, 1, page)
    moved = madvise(address, page, MADV_COLLAPSE) == 0
    del buffer
    region.close()
    return moved


needs_collapse = pytest.mark.skipif(
    not _can_collapse(), reason="madvise(MADV_COLLAPSE): Linux 6.1 and later, with THP"
)


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the mapping holding the tensor's first byte that lie on transparent huge
    pages (/proc/self/smaps' AnonHugePages)."""
    address = tensor.data_ptr()
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                start, end = (int(part, 16) for part in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "AnonHugePages:":
                return int(fields[1]) * 1024
    raise AssertionError("no mapping holds the tensor")


@contextlib.contextmanager
def cpu_memory_log_lines(monkeypatch) -> Iterator[list[str]]:
    """cpu_memory's INFO lines while the block runs, read at the module's logger itself: a
    logging configuration applied earlier in the session (dictConfig) may have disabled the
    loggers that existed then, or cut their way to the root."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    monkeypatch.setattr(cpu_memory.logger, "disabled", False)
    cpu_memory.logger.addHandler(handler)
    level = cpu_memory.logger.level
    cpu_memory.logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        cpu_memory.logger.removeHandler(handler)
        cpu_memory.logger.setLevel(level)
