"""A CPU worker moves its model's weights onto transparent huge pages while the engine core
is idle (worker/cpu_memory.py, WeightHugePages): every huge page that holds part of a
weight and lies inside one private anonymous mapping, one page per call, addresses and
contents kept; nothing more where the kernel lacks the call; off with
--no-weight-huge-pages."""

from __future__ import annotations

import argparse
import ctypes
import errno
import mmap

import pytest
import torch

from tests.gguf_blocks import random_quantized
from tests.memory_pages import cpu_memory_log_lines, huge_page_bytes, needs_collapse
from tokenserve.core.engine_core import EngineCore
from tokenserve.engine.cli_args import add_engine_arguments, engine_args_from
from tokenserve.kernels import quant_linear
from tokenserve.worker import cpu_memory
from tokenserve.worker.cpu_memory import (
    WeightHugePages,
    anonymous_mappings,
    huge_page_size,
    huge_pages_holding,
)
from tokenserve.worker.model_runner import weight_tensors

MiB = 1 << 20
PAGE = 2 * MiB


def test_the_pages_holding_each_span_that_lie_inside_its_mapping():
    mappings = [(1 * MiB, 9 * MiB), (16 * MiB, 20 * MiB)]
    spans = [
        (3 * MiB, 100),          # inside the page at 2 MiB
        (3 * MiB + 200, 4096),   # the same page again: once
        (5 * MiB, 2 * MiB),      # pages at 4 and 6 MiB
        (1 * MiB, 512 << 10),    # the page at 0 starts before the mapping: left out
        (8 * MiB + 4096, 4096),  # the page at 8 MiB ends past the mapping: left out
        (12 * MiB, MiB),         # in no mapping
        (18 * MiB, 0),           # empty
        (19 * MiB, MiB),         # the page at 18 MiB, in the second mapping
    ]
    assert huge_pages_holding(spans, mappings, PAGE) == [2 * MiB, 4 * MiB, 6 * MiB, 18 * MiB]


def test_only_private_writable_mappings_no_file_backs(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/python3\n"
        "00651000-00652000 rw-p 00051000 08:02 173521 /usr/bin/python3\n"
        "01000000-05000000 rw-p 00000000 00:00 0 [heap]\n"
        "7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \n"
        "7f0000400000-7f0000800000 rw-s 00000000 00:01 9 /dev/zero (deleted)\n"
        "7f0000800000-7f0000c00000 r--p 00000000 00:00 0 \n"
        "7f0000c00000-7f0001000000 rw-p 00000000 00:00 0\n"
        "7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0 [stack]\n"
    )
    assert anonymous_mappings(str(maps)) == [
        (0x01000000, 0x05000000), (0x7F0000000000, 0x7F0000400000),
        (0x7F0000C00000, 0x7F0001000000),
    ]


def _anonymous_tensor(nbytes: int) -> torch.Tensor:
    """A uint8 tensor filling a fresh private anonymous mapping, written with random bytes."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(region, dtype=torch.uint8)
    tensor.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(0)))
    return tensor  # it holds the mapping


@needs_collapse
def test_a_tensor_moves_onto_huge_pages_with_its_contents():
    assert huge_page_size() == PAGE  # x86-64's, as the figures assume
    tensor = _anonymous_tensor(12 * MiB)
    before, address = tensor.clone(), tensor.data_ptr()
    assert huge_page_bytes(tensor) == 0
    pages = WeightHugePages([tensor[MiB:]])  # a view: its whole storage counts
    # Five whole huge pages lie inside the 12 MiB (six where the mapping starts on one).
    assert len(pages.pages) in (5, 6)
    calls = 1
    while pages.step():
        calls += 1
    assert calls == len(pages.pages)  # one a call
    assert pages.moved == len(pages.pages) and not pages.refusals
    assert huge_page_bytes(tensor) == len(pages.pages) * PAGE
    assert tensor.data_ptr() == address and torch.equal(tensor, before)
    assert not pages.step()


def _refusing_madvise(monkeypatch, errors: list[int]) -> list[int]:
    """madvise failing with errors[i] at its i-th call (0: success); the addresses it got."""
    calls: list[int] = []

    def madvise(address: int, length: int, advice: int) -> int:
        assert length == PAGE and advice == cpu_memory.MADV_COLLAPSE
        calls.append(address)
        error = errors[len(calls) - 1]
        ctypes.set_errno(error)
        return -1 if error else 0

    monkeypatch.setattr(cpu_memory, "_madvise", lambda: madvise)
    monkeypatch.setattr(cpu_memory, "huge_page_size", lambda: PAGE)
    return calls


def test_nothing_more_is_tried_where_the_kernel_lacks_the_call(monkeypatch):
    calls = _refusing_madvise(monkeypatch, [errno.EINVAL])
    tensor = _anonymous_tensor(12 * MiB)
    with cpu_memory_log_lines(monkeypatch) as lines:
        pages = WeightHugePages([tensor])
        assert len(pages.pages) >= 5
        assert not pages.step()
    assert len(calls) == 1 and pages.moved == 0
    [line] = lines
    assert "stay on 4 KiB pages" in line and "MADV_COLLAPSE" in line
    assert not pages.step() and len(calls) == 1


def test_a_page_refused_for_want_of_memory_is_left_and_the_next_tried(monkeypatch):
    calls = _refusing_madvise(monkeypatch, [0, errno.ENOMEM, errno.EAGAIN, 0, 0, 0])
    tensor = _anonymous_tensor(12 * MiB)
    with cpu_memory_log_lines(monkeypatch) as lines:
        pages = WeightHugePages([tensor])
        while pages.step():
            pass
    assert calls == pages.pages  # each once, in order
    assert pages.moved == len(pages.pages) - 2
    assert pages.refusals == {errno.ENOMEM: 1, errno.EAGAIN: 1}
    [line] = lines
    assert f"{(len(pages.pages) - 2) * 2} MiB moved" in line and "1 refused" in line


def test_the_weights_are_every_parameter_and_the_8_bit_kernels_copies():
    ops = quant_linear.load()
    if ops is None or not ops.i8:
        pytest.skip("no 8-bit kernel on this CPU's level (x86-64 only)")
    layer = torch.nn.Linear(64, 32)
    blocks, _ = random_quantized("Q4_1", 32, 64)
    blocks.i8_max_rows = 4
    layer.blocks = blocks
    model = torch.nn.Sequential(layer, torch.nn.LayerNorm(32))
    tensors = weight_tensors(model)
    ids = {id(tensor) for tensor in tensors}
    assert all(id(parameter) in ids for parameter in model.parameters())
    assert id(blocks.qs) in ids and id(blocks.scales) in ids
    # The 8-bit kernel's copy, made here and not again at the first product of few rows.
    assert id(blocks.i8_weight()) in ids
    blocks.i8_max_rows = 0
    assert id(blocks.i8_weight()) not in {id(tensor) for tensor in weight_tensors(model)}


def _core(model_dir: str, *flags: str) -> EngineCore:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, positional_model=False)
    args = parser.parse_args(["--model", model_dir, "--kv-cache-memory", "8MiB", *flags])
    return EngineCore(engine_args_from(args).create_engine_config())


def _weight_pages(core: EngineCore) -> WeightHugePages | None:
    [pages] = core.collective_rpc(lambda worker: worker.model_runner.weight_pages)
    return pages


@needs_collapse
def test_an_idle_engine_core_moves_its_weights_last_in_its_warm_up(tiny_model_dirs):
    core = _core(tiny_model_dirs["llama"])
    while core.warm_up():
        pass
    pages = _weight_pages(core)
    assert pages is not None and pages.pages and pages.done == len(pages.pages)
    assert pages.moved > 0


def test_no_weight_huge_pages_leaves_the_weights_where_they_are(tiny_model_dirs):
    core = _core(tiny_model_dirs["llama"], "--no-weight-huge-pages")
    assert not core.config.kernel_config.weight_huge_pages
    while core.warm_up():
        pass
    pages = _weight_pages(core)
    assert pages is not None and pages.pages == [] and pages.moved == 0
