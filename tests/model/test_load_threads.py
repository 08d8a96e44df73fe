"""A model load's torch threads (model/load_threads.py): a small model loads on one thread,
torch gets its thread count back afterwards (also after a failed load), a large model keeps
the pool, and the model loaded on one thread is the model loaded on the pool."""

from __future__ import annotations

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


def test_a_small_model_loads_on_one_thread_and_torch_gets_its_threads_back(two_threads):
    model = torch.nn.Linear(64, 64)
    assert load_threads.parameter_bytes(model) == (64 * 64 + 64) * 4
    with load_threads.load_threads(model) as threads:
        assert threads == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), load_threads.load_threads(model):
        raise RuntimeError("a failed load")
    assert torch.get_num_threads() == 2


def test_a_large_model_keeps_the_pool(two_threads, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(load_threads, "ONE_THREAD_MAX_BYTES", 1000)
    with load_threads.load_threads(torch.nn.Linear(64, 64)) as threads:
        assert threads == 2 and torch.get_num_threads() == 2
    assert torch.get_num_threads() == 2


def test_a_gguf_model_loaded_on_one_thread_is_the_model_loaded_on_the_pool(
    two_threads, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    gguf = write_quantized_gguf(tmp_path / "tiny-q4_1.gguf")
    seen: list[int] = []
    process = registry.process_weights_after_loading

    def spy(model: torch.nn.Module) -> None:
        seen.append(torch.get_num_threads())
        process(model)

    monkeypatch.setattr(registry, "process_weights_after_loading", spy)
    model_state(gguf)  # fills the cache: both loads below are hits
    one_thread = model_state(gguf)
    monkeypatch.setattr(load_threads, "ONE_THREAD_MAX_BYTES", -1)
    pool = model_state(gguf)
    assert seen == [1, 1, 2] and torch.get_num_threads() == 2
    assert one_thread.keys() == pool.keys()
    for name, tensor in pool.items():
        assert one_thread[name].dtype == tensor.dtype and torch.equal(one_thread[name], tensor), name
