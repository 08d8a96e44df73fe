"""The executor between the engine core and the model: the engine core holds an executor and
never a model runner, `collective_rpc` answers once per worker, the backend is a setting."""

from __future__ import annotations

import pytest

from tokenserve import LLM, SamplingParams
from tokenserve.config import ParallelConfig
from tokenserve.core.engine_core import EngineCore
from tokenserve.core.request import Request
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.executor.abstract import Executor, run_method
from tokenserve.executor.uniprocess import UniprocessExecutor
from tokenserve.messages.model_runner_output import ModelRunnerOutput
from tokenserve.messages.scheduler_output import SchedulerOutput
from tokenserve.worker.model_runner import ModelRunner
from tokenserve.worker.worker import Worker


@pytest.fixture(scope="module")
def config(tiny_model_dirs):
    return EngineArgs(model=tiny_model_dirs["llama"], kv_cache_memory="8MiB").create_engine_config()


class FakeWorker:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.calls: list[str] = []

    def load_model(self) -> None:
        self.calls.append("load_model")

    def initialize_kv_cache(self) -> None:
        self.calls.append("initialize_kv_cache")

    def execute_model(self, scheduler_output, grammar_bitmask=None) -> ModelRunnerOutput:
        self.calls.append("execute_model")
        return ModelRunnerOutput(["r"], [[self.rank]])


class TwoWorkerExecutor(Executor):
    """Two in-process stand-in workers: what the base class does with several ranks."""

    def _init_executor(self) -> None:
        self.workers = [FakeWorker(0), FakeWorker(1)]

    def collective_rpc(self, method, args=(), kwargs=None):
        return [run_method(worker, method, args, kwargs or {}) for worker in self.workers]

    def shutdown(self) -> None:
        self.workers = []


def test_collective_rpc_answers_once_per_worker_in_rank_order(config):
    executor = TwoWorkerExecutor(config)
    assert executor.collective_rpc(lambda worker: worker.rank) == [0, 1]
    assert executor.collective_rpc(
        lambda worker, a, *, b: (worker.rank, a, b), args=(1,), kwargs={"b": 2}
    ) == [(0, 1, 2), (1, 1, 2)]
    # Every worker loads the model and allocates its KV cache; a step runs on all of them
    # and the first rank's output is the step's.
    executor.initialize_kv_cache()
    assert executor.execute_model(SchedulerOutput()).sampled_token_ids == [[0]]
    for worker in executor.workers:
        assert worker.calls == ["load_model", "initialize_kv_cache", "execute_model"]


def test_uniprocess_executor_runs_one_worker_in_process(config):
    executor = UniprocessExecutor(config)
    [worker] = executor.collective_rpc(lambda worker: worker)
    assert isinstance(worker, Worker) and isinstance(worker.model_runner, ModelRunner)
    assert worker.model_runner.model is not None  # loaded on construction
    assert executor.collective_rpc("initialize_kv_cache") == [None]
    assert len(worker.model_runner.kv_caches) == config.model_config.num_layers
    executor.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        executor.collective_rpc("load_model")


def test_the_engine_core_holds_an_executor_and_no_model_runner(config):
    core = EngineCore(config)
    assert isinstance(core.executor, UniprocessExecutor)
    held = list(vars(core).values()) + list(vars(core.scheduler).values())
    assert not any(isinstance(value, (ModelRunner, Worker)) for value in held)
    assert core.collective_rpc(lambda worker: type(worker.model_runner)) == [ModelRunner]


class RecordingExecutor(UniprocessExecutor):
    def _init_executor(self) -> None:
        super()._init_executor()
        self.calls: list[str] = []

    def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append(method if isinstance(method, str) else "callable")
        return super().collective_rpc(method, args, kwargs)


def test_every_step_goes_through_the_executor(config):
    core = EngineCore(config, executor_class=RecordingExecutor)
    assert core.executor.calls == ["load_model", "initialize_kv_cache"]
    core.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=3), eos_token_id=None))
    new_tokens = []
    while core.has_unfinished_requests():
        new_tokens += [t for output in core.step() for t in output.new_token_ids]
    assert len(new_tokens) == 3
    assert core.executor.calls[2:] == ["execute_model"] * 3


def test_an_unknown_executor_backend_is_refused_with_the_settings():
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        ParallelConfig("threads")
    # Before the model is even looked for.
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        EngineArgs(model="/nonexistent", distributed_executor_backend="nccl").create_engine_config()
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM("/nonexistent", distributed_executor_backend="threads")
