"""Tensor and pipeline parallelism on two ranks (the mp executor, one core each) give the
one-rank engine's greedy tokens and logprobs under chunked prefill, preemption and
prefix-cache hits, on Llama and on Qwen2 (GQA, qkv bias, tied embeddings)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.conftest import tiny_model_config
from tests.distributed.parallel_workload import (
    SETTINGS,
    assert_same_as,
    gguf_block_layers,
    kv_cache_shapes,
    record_steps_under_way,
    run_workload,
)
from tokenserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def references(tiny_model_dirs):
    results = {}
    for family in ("llama", "qwen2"):
        llm = LLM(tiny_model_dirs[family], **SETTINGS)
        vocab_size = llm.llm_engine.config.model_config.vocab_size
        results[family] = (run_workload(llm, vocab_size), vocab_size)
    return results


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"]
)
def test_two_ranks_give_one_ranks_tokens_and_logprobs(tiny_model_dirs, references, family, layout):
    reference, vocab_size = references[family]
    llm = LLM(tiny_model_dirs[family], **SETTINGS, **layout)
    try:
        executor = llm.llm_engine.engine_core.executor
        assert type(executor).__name__ == "MultiprocExecutor"  # the default for two ranks
        pipeline = "pipeline_parallel_size" in layout
        steps_under_way = record_steps_under_way(llm)
        result = run_workload(llm, vocab_size)
        assert_same_as(result, reference, same_schedule=not pipeline)
        # Two stages take two steps at once: a step is sent before the one before it is back.
        assert max(steps_under_way) == (2 if pipeline else 1)
        # Each rank's cache holds its own KV heads (tp) or its own layers (pp).
        shapes = llm.llm_engine.collective_rpc(kv_cache_shapes)
        assert len(shapes) == 2 and shapes[0] == shapes[1]
        if "tensor_parallel_size" in layout:
            assert len(shapes[0]) == 2 and shapes[0][0][2] == 1  # 2 layers, 1 of 2 KV heads
        else:
            assert len(shapes[0]) == 1 and shapes[0][0][2] == 2  # 1 of 2 layers, 2 KV heads
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_the_default_gguf_model_in_two_pipeline_stages(default_model_path):
    """SmolLM2-135M Q4_1 (its 9 heads do not split over 2 tensor-parallel ranks; its 30
    layers split over 2 stages): the one-rank engine's greedy tokens, each stage keeping
    its layers' GGUF blocks."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    reference = LLM(default_model_path, kv_cache_memory="32MiB").generate(
        prompts, params, use_tqdm=False
    )
    llm = LLM(default_model_path, kv_cache_memory="32MiB", pipeline_parallel_size=2)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [
            o.outputs[0].token_ids for o in reference
        ]
        assert llm.llm_engine.collective_rpc(gguf_block_layers) == [15, 15]
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_fewer_kv_heads_than_ranks_are_replicated(tiny_tokenizer_dir, tmp_path):
    """A tiny Llama with one KV head at TP=2: each rank holds that head (its cache too) and
    the tokens and logprobs are one rank's."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    config = tiny_model_config("llama", vocab_size=len(tokenizer))
    config.num_key_value_heads = 1
    with torch.random.fork_rng():
        torch.manual_seed(3)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = ["Hello there, how are", "The sky is blue because"]

    def run(llm: LLM) -> list[list[tuple[int, float]]]:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [
            [(t, step[t].logprob) for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
            for o in outputs
        ]

    reference = run(LLM(str(tmp_path), kv_cache_memory="1MiB"))
    llm = LLM(str(tmp_path), kv_cache_memory="1MiB", tensor_parallel_size=2)
    try:
        got = run(llm)
        assert [[t for t, _ in row] for row in got] == [[t for t, _ in row] for row in reference]
        for row, expected in zip(got, reference):
            assert max(abs(a[1] - b[1]) for a, b in zip(row, expected)) < 1e-4
        assert [shapes[0][2] for shapes in llm.llm_engine.collective_rpc(kv_cache_shapes)] == [1, 1]
    finally:
        llm.llm_engine.engine_core.shutdown()
