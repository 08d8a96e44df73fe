"""An idle engine core faults its KV cache in ahead of use (worker/cpu_memory.py): through
the executor, lowest blocks first, a time slice per call while no input waits, contents
kept; off with --no-kv-cache-prefault."""

from __future__ import annotations

import argparse
import queue

import pytest

from tests.core.greedy import greedy_tokens
from tests.memory_pages import needs_populate, resident_pages
from tokenserve import SamplingParams
from tokenserve.core.engine_core import EngineCore
from tokenserve.core.engine_core_proc import PREFAULT_SLICE_SECONDS, EngineCoreProc
from tokenserve.core.request import Request
from tokenserve.engine.cli_args import add_engine_arguments, engine_args_from
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.worker.cpu_memory import PREFAULT_PIECE_BYTES


def _kv_caches(core: EngineCore):
    [caches] = core.collective_rpc(lambda worker: worker.model_runner.kv_caches)
    return caches


@needs_populate
def test_an_idle_engine_core_faults_its_whole_kv_cache_in(tiny_model_dirs):
    config = EngineArgs(model=tiny_model_dirs["llama"],
                        kv_cache_memory="8MiB").create_engine_config()
    assert config.cache_config.prefault_when_idle
    core = EngineCore(config)
    caches = _kv_caches(core)
    assert not all(all(resident_pages(cache)) for cache in caches)
    total = sum(cache.numel() * cache.element_size() for cache in caches)
    calls = 1
    while core.prefault_kv_cache(0.0):  # a slice of no time: one piece a call
        calls += 1
    assert calls >= total / PREFAULT_PIECE_BYTES  # at most a piece each
    assert all(all(resident_pages(cache)) for cache in caches)
    assert not core.prefault_kv_cache(1.0)
    # Faulted in, still zeros: the same tokens as an engine that faults its pages on use.
    unfaulted = EngineCore(
        EngineArgs(model=tiny_model_dirs["llama"], kv_cache_memory="8MiB",
                   kv_cache_prefault=False).create_engine_config()
    )
    assert greedy_tokens(core) == greedy_tokens(unfaulted)
    # Only between steps.
    core.add_request(Request("s", [5, 6], SamplingParams(max_tokens=2), eos_token_id=None))
    with pytest.raises(AssertionError, match="only while idle"):
        core.prefault_kv_cache(1.0)


def test_no_kv_cache_prefault_leaves_the_pages_to_first_use(tiny_model_dirs):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, positional_model=False)
    args = parser.parse_args(
        ["--model", tiny_model_dirs["llama"], "--kv-cache-memory", "8MiB", "--no-kv-cache-prefault"]
    )
    config = engine_args_from(args).create_engine_config()
    assert not config.cache_config.prefault_when_idle
    core = EngineCore(config)
    resident_before = [resident_pages(cache) for cache in _kv_caches(core)]
    assert not core.prefault_kv_cache(1.0)
    assert [resident_pages(cache) for cache in _kv_caches(core)] == resident_before


class _IdleCore:
    """The engine core as the idle loop sees it: faults slices in until told it is done."""

    def __init__(self, inputs: queue.Queue, slices_left: int, input_after: int | None) -> None:
        self.inputs, self.slices_left, self.input_after = inputs, slices_left, input_after
        self.calls: list[int] = []

    def prefault_kv_cache(self, max_seconds: float) -> bool:
        self.calls.append(max_seconds)
        if len(self.calls) == self.input_after:
            self.inputs.put(("ADD", "request"))  # arrives while this slice is faulted in
        self.slices_left -= 1
        return self.slices_left > 0


def _idle_loop(slices_left: int, input_after: int | None) -> tuple[EngineCoreProc, _IdleCore]:
    proc = EngineCoreProc.__new__(EngineCoreProc)  # no sockets: the loop's own state only
    proc.input_queue = queue.Queue()
    proc.warming = False  # the products' warm-up: tests/core/test_product_warm_up.py
    proc.prefaulting = True
    proc.engine_core = _IdleCore(proc.input_queue, slices_left, input_after)
    return proc, proc.engine_core


def test_the_idle_loop_faults_slices_in_until_an_input_comes():
    proc, core = _idle_loop(slices_left=10, input_after=3)
    assert proc._next_input_while_idle() == ("ADD", "request")
    assert core.calls == [PREFAULT_SLICE_SECONDS] * 3  # the input is taken after that slice
    assert proc.prefaulting
    # An input already waiting is taken at once.
    proc.input_queue.put(("ABORT", ["r"]))
    assert proc._next_input_while_idle() == ("ABORT", ["r"])
    assert len(core.calls) == 3


def test_the_idle_loop_blocks_on_the_queue_once_all_is_faulted_in(monkeypatch):
    proc, core = _idle_loop(slices_left=2, input_after=2)  # the input comes with the last
    blocking_gets = []  # how many slices were faulted in at each blocking get
    get = proc.input_queue.get

    def recording_get(block=True, timeout=None):
        if block:
            blocking_gets.append(len(core.calls))
        return get(block, timeout)

    monkeypatch.setattr(proc.input_queue, "get", recording_get)
    assert proc._next_input_while_idle() == ("ADD", "request")
    assert not proc.prefaulting and core.calls == [PREFAULT_SLICE_SECONDS] * 2
    assert blocking_gets == [2]
    # Nothing is left to fault in: the next wait is a blocking get, and no slice.
    proc.input_queue.put(("ABORT", ["r"]))
    assert proc._next_input_while_idle() == ("ABORT", ["r"])
    assert blocking_gets == [2, 2] and len(core.calls) == 2
