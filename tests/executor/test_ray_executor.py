"""TP=2 with the Ray executor, on a local Ray instance this test starts and stops: the
one-rank engine's tokens and logprobs, each rank a Ray actor."""

from __future__ import annotations

import pytest

from tests.distributed.parallel_workload import (
    SETTINGS,
    assert_same_as,
    kv_cache_shapes,
    run_workload,
)
from tokenserve import LLM

ray = pytest.importorskip("ray")


@pytest.fixture
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_tensor_parallel_on_ray_actors(tiny_model_dirs, local_ray):
    reference_llm = LLM(tiny_model_dirs["llama"], **SETTINGS)
    vocab_size = reference_llm.llm_engine.config.model_config.vocab_size
    reference = run_workload(reference_llm, vocab_size)
    llm = LLM(tiny_model_dirs["llama"], **SETTINGS, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    core = llm.llm_engine.engine_core
    try:
        assert type(core.executor).__name__ == "RayExecutor"
        assert_same_as(run_workload(llm, vocab_size), reference)
        assert [shapes[0][2] for shapes in llm.llm_engine.collective_rpc(kv_cache_shapes)] == [1, 1]
    finally:
        core.shutdown()
    assert core.executor.actors == [] and core.executor.placement_group is None  # given back
