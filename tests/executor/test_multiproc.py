"""The multiprocess executor and the parallel settings: errors at start (sizes that do not
divide the model, more ranks than cores, a missing Ray, features not split yet), each rank's
KV budget, the flags, and a worker that fails or dies as an error, not a hang."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

from tests.distributed.parallel_workload import kv_cache_shapes
from tokenserve import LLM, SamplingParams
from tokenserve.distributed import cpu_binding
from tokenserve.engine.cli_args import add_engine_arguments, engine_args_from
from tokenserve.engine.engine_args import EngineArgs


def _config(model: str, **kwargs):
    return EngineArgs(model=model, kv_cache_memory="1MiB", **kwargs).create_engine_config()


def test_sizes_that_do_not_divide_the_model_are_refused(tiny_model_dirs):
    llama = tiny_model_dirs["llama"]  # 4 heads, 2 KV heads, 2 layers
    with pytest.raises(ValueError, match="4 attention heads do not split over tensor_parallel_size=3"):
        _config(llama, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="2 layers do not split over pipeline_parallel_size=3"):
        _config(llama, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        _config(llama, tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        _config(llama, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="does not support enable_lora"):
        _config(llama, tensor_parallel_size=2, enable_lora=True)


def test_the_default_model_does_not_split_over_two_ranks(default_model_path):
    """SmolLM2-135M has 9 heads (3 KV heads): tensor parallel needs 3 or 9 ranks."""
    with pytest.raises(ValueError, match="9 attention heads do not split over tensor_parallel_size=2"):
        _config(default_model_path, tensor_parallel_size=2)


def test_each_rank_budgets_its_own_heads_and_layers(tiny_model_dirs):
    """kv_cache_memory is each rank's: half the heads or half the layers, twice the blocks;
    with more ranks than KV heads each rank holds one head (replicated)."""
    llama = tiny_model_dirs["llama"]
    one = _config(llama).cache_config.num_blocks
    assert _config(llama, tensor_parallel_size=2).cache_config.num_blocks == 2 * one
    assert _config(llama, pipeline_parallel_size=2).cache_config.num_blocks == 2 * one
    assert _config(llama, tensor_parallel_size=4).cache_config.num_blocks == 2 * one
    assert _config(llama, tensor_parallel_size=2).parallel_config.distributed_executor_backend == "mp"
    assert _config(llama).parallel_config.distributed_executor_backend == "uni"


def test_flags_have_vllms_names():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, positional_model=False)
    args = engine_args_from(parser.parse_args(
        ["-tp", "2", "--pipeline-parallel-size", "2", "--distributed-executor-backend", "ray"]
    ))
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 2)
    assert args.distributed_executor_backend == "ray"
    args = engine_args_from(parser.parse_args(["--tensor-parallel-size", "2", "-pp", "1"]))
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (2, None)


def test_more_ranks_than_cores_is_refused_at_start(tiny_model_dirs, monkeypatch):
    monkeypatch.setattr(cpu_binding.os, "sched_getaffinity", lambda pid: {0, 1})
    assert cpu_binding.cpus_for_ranks(2) == [[0], [1]]
    with pytest.raises(ValueError, match="4 ranks need at least 4 CPU cores"):
        LLM(tiny_model_dirs["llama"], kv_cache_memory="1MiB", tensor_parallel_size=4)


def test_a_missing_ray_names_the_extra(tiny_model_dirs, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    with pytest.raises(ValueError, match=r"pip install tokenserve\[ray\]"):
        LLM(tiny_model_dirs["llama"], kv_cache_memory="1MiB", tensor_parallel_size=2,
            distributed_executor_backend="ray")


def fail_on_rank_one(worker) -> int:
    if worker.rank == 1:
        raise KeyError("rank one's failure")
    return worker.rank


def worker_pid(worker) -> int:
    return os.getpid()


def test_a_worker_that_fails_or_dies_is_an_error_not_a_hang(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], kv_cache_memory="1MiB", tensor_parallel_size=2)
    core = llm.llm_engine.engine_core
    try:
        pids = llm.llm_engine.collective_rpc(worker_pid)
        assert len(set(pids)) == 2 and os.getpid() not in pids  # a process per rank
        assert [len(shapes) for shapes in llm.llm_engine.collective_rpc(kv_cache_shapes)] == [2, 2]
        with pytest.raises(RuntimeError, match="(?s)worker rank 1 failed.*rank one"):
            llm.llm_engine.collective_rpc(fail_on_rank_one)
        core.executor.workers[1].process.kill()
        with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) died"):
            llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        core.shutdown()
    assert core.executor.workers == []
