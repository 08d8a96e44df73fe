"""TP=2 and PP=2 with the Ray executor, on a local Ray instance this module starts and
stops: the one-rank engine's tokens and logprobs, each rank a Ray actor (PP=2: two steps
under way at once)."""

from __future__ import annotations

import pytest

from tests.distributed.parallel_workload import (
    SETTINGS,
    assert_same_as,
    kv_cache_shapes,
    record_steps_under_way,
    run_workload,
)
from tokenserve import LLM

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    reference_llm = LLM(tiny_model_dirs["llama"], **SETTINGS)
    vocab_size = reference_llm.llm_engine.config.model_config.vocab_size
    return run_workload(reference_llm, vocab_size), vocab_size


@pytest.mark.parametrize("layout", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_two_ranks_on_ray_actors(tiny_model_dirs, local_ray, reference, layout):
    expected, vocab_size = reference
    llm = LLM(tiny_model_dirs["llama"], **SETTINGS, **{layout: 2},
              distributed_executor_backend="ray")
    core = llm.llm_engine.engine_core
    pipeline = layout == "pipeline_parallel_size"
    try:
        assert type(core.executor).__name__ == "RayExecutor"
        steps_under_way = record_steps_under_way(llm)
        assert_same_as(run_workload(llm, vocab_size), expected, same_schedule=not pipeline)
        assert max(steps_under_way) == (2 if pipeline else 1)
        shapes = llm.llm_engine.collective_rpc(kv_cache_shapes)
        if pipeline:  # one layer of two per stage, both KV heads
            assert [(len(s), s[0][2]) for s in shapes] == [(1, 2), (1, 2)]
        else:  # both layers, one KV head of two per rank
            assert [(len(s), s[0][2]) for s in shapes] == [(2, 1), (2, 1)]
    finally:
        core.shutdown()
    assert core.executor.actors == [] and core.executor.placement_group is None  # given back
