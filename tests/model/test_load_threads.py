"""A model load's threads (model/load_threads.py): a small model's operations run on worker
threads, one per torch thread, each operation on one torch thread; torch gets its thread
count back afterwards (also after a failed load); a large model keeps the pool, one operation
at a time; a failed operation fails the load; and the model loaded by the workers is the
model loaded one operation at a time."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.model.test_weight_cache import write_quantized_gguf
from tests.model.test_weight_cache_dtypes import model_state
from tokenserve.cache_dir import CACHE_DIR_ENV
from tokenserve.model import load_threads, registry


@pytest.fixture
def two_threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def test_a_small_model_loads_on_workers_of_one_torch_thread_and_torch_gets_its_threads_back(
    two_threads,
):
    model = torch.nn.Linear(64, 64)
    assert load_threads.parameter_bytes(model) == (64 * 64 + 64) * 4
    with load_threads.load_threads(model) as workers:
        assert workers.count == 2 and torch.get_num_threads() == 1
        seen: list[int] = []
        for _ in range(4):
            workers.submit(lambda: seen.append(torch.get_num_threads()))
        workers.wait()
        assert seen == [1, 1, 1, 1]
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), load_threads.load_threads(model):
        raise RuntimeError("a failed load")
    assert torch.get_num_threads() == 2


def test_a_large_model_keeps_the_pool(two_threads, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(load_threads, "ONE_THREAD_MAX_BYTES", 1000)
    with load_threads.load_threads(torch.nn.Linear(64, 64)) as workers:
        assert workers.count == 1 and torch.get_num_threads() == 2
    assert torch.get_num_threads() == 2


def test_a_failed_operation_fails_the_wait_after_the_others_ran(two_threads):
    done: list[int] = []

    def fail() -> None:
        raise ValueError("shape (3,) does not fit")

    with load_threads.load_threads(torch.nn.Linear(4, 4)) as workers:
        workers.submit(fail)
        for index in range(8):
            workers.submit(done.append, index)
        with pytest.raises(ValueError, match="does not fit"):
            workers.wait()
        assert sorted(done) == list(range(8))
        workers.wait()  # nothing left to report


def test_the_submitting_loop_waits_while_each_worker_has_its_share_queued(two_threads):
    # The tensors a queued copy reads stay in memory until it runs: the queue is bounded.
    release = threading.Event()
    limit = 2 * load_threads.QUEUED_PER_WORKER
    submitted: list[int] = []

    def submit_all(workers: load_threads.LoadWorkers) -> None:
        for index in range(limit + 4):
            workers.submit(release.wait)
            submitted.append(index)

    with load_threads.load_threads(torch.nn.Linear(4, 4)) as workers:
        submitter = threading.Thread(target=submit_all, args=(workers,))
        submitter.start()
        submitter.join(timeout=1.0)
        # Blocked until the gated operations run, however long that takes.
        assert submitter.is_alive() and len(submitted) <= limit
        release.set()
        submitter.join()
        workers.wait()
    assert submitted == list(range(limit + 4))


def test_a_gguf_model_loaded_by_the_workers_is_the_model_loaded_one_operation_at_a_time(
    two_threads, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    gguf = write_quantized_gguf(tmp_path / "tiny-q4_1.gguf")
    seen: list[tuple[int, int]] = []
    process = registry.process_weights_after_loading

    def spy(model: torch.nn.Module, workers: load_threads.LoadWorkers, pack: bool) -> None:
        seen.append((workers.count, torch.get_num_threads()))
        process(model, workers, pack)

    monkeypatch.setattr(registry, "process_weights_after_loading", spy)
    model_state(gguf)  # fills the cache: both loads below are hits
    workers = model_state(gguf)
    monkeypatch.setattr(load_threads, "ONE_THREAD_MAX_BYTES", -1)
    one_at_a_time = model_state(gguf)
    assert seen == [(2, 1), (2, 1), (1, 2)] and torch.get_num_threads() == 2
    assert workers.keys() == one_at_a_time.keys()
    for name, tensor in one_at_a_time.items():
        assert workers[name].dtype == tensor.dtype and torch.equal(workers[name], tensor), name
