"""Pooling requests at the edge and through the engine: what a model cannot do is a
ValueError before anything reaches the engine core; a pooling request ends with its prompt
and gives its blocks back."""

from __future__ import annotations

import pytest

from tokenserve.engine.engine_args import EngineArgs
from tokenserve.engine.pooling_requests import token_type_start
from tokenserve.entrypoints.llm import LLM
from tokenserve.pooling_params import PoolingParams


def test_pooling_params_are_checked():
    with pytest.raises(ValueError, match="task must be one of"):
        PoolingParams(task="generate")
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)


def test_token_types_of_a_pair():
    assert token_type_start([0, 0, 0, 1, 1], 5) == 3
    assert token_type_start([0, 0], 2) is None
    with pytest.raises(ValueError, match="0s followed by 1s"):
        token_type_start([0, 1, 0], 3)
    with pytest.raises(ValueError, match="entries for a prompt of 4 tokens"):
        token_type_start([0, 1], 4)


def test_runner_settings_are_checked(tiny_model_dirs, default_model_path):
    model = tiny_model_dirs["llama"]
    with pytest.raises(ValueError, match="runner must be one of"):
        EngineArgs(model=model, runner="embed", num_kv_blocks=4).create_engine_config()
    with pytest.raises(ValueError, match="pooler_config applies only"):
        EngineArgs(
            model=model, pooler_config={"pooling_type": "MEAN"}, num_kv_blocks=4
        ).create_engine_config()
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        EngineArgs(
            model=model, runner="pooling", pooler_config={"pooling_type": "MAX"}, num_kv_blocks=4
        ).create_engine_config()
    with pytest.raises(ValueError, match="not GGUF"):
        EngineArgs(
            model=default_model_path, runner="pooling", num_kv_blocks=4
        ).create_engine_config()


def test_generate_model_refuses_pooling_and_pooling_request_frees_blocks(tiny_model_dirs):
    generate = LLM(tiny_model_dirs["qwen2"], num_kv_blocks=8, block_size=16)
    with pytest.raises(ValueError, match="runs the 'generate' runner"):
        generate.embed("Hello", use_tqdm=False)
    assert not generate.llm_engine.has_unfinished_requests()

    pooling = LLM(tiny_model_dirs["qwen2"], runner="pooling", num_kv_blocks=8, block_size=16)
    with pytest.raises(ValueError, match="does not support the 'classify' task"):
        pooling.classify("Hello", use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        pooling.embed("Hello", PoolingParams(truncate_prompt_tokens=10**6), use_tqdm=False)
    outputs = pooling.embed(["Hello, world!", "Hello, world! How are you?"], use_tqdm=False)
    assert [o.finished for o in outputs] == [True, True]
    # Token-id prompts truncate to their last tokens.
    ids = outputs[1].prompt_token_ids
    truncated = pooling.embed(ids, PoolingParams(truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert truncated.prompt_token_ids == ids[-3:]
    assert pooling.llm_engine.get_stats().kv_cache_usage == 0
    assert not pooling.llm_engine.has_unfinished_requests()
