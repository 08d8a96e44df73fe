"""`speculative_config` and `--speculative-config`: vLLM's keys, defaults and clear errors."""

from __future__ import annotations

import argparse

import pytest

from tokenserve.engine.cli_args import add_engine_arguments, engine_args_from
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.entrypoints.llm import LLM


def config_of(tiny_model_dirs, speculative_config, **extra):
    args = EngineArgs(
        model=tiny_model_dirs["llama"],
        kv_cache_memory="8MiB",
        speculative_config=speculative_config,
        **extra,
    )
    return args.create_engine_config()


def test_ngram_defaults_and_bounds(tiny_model_dirs):
    spec = config_of(tiny_model_dirs, {"method": "ngram", "num_speculative_tokens": 3})
    spec = spec.speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    assert spec.num_lookahead_tokens == 0
    one_bound = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    spec = config_of(tiny_model_dirs, one_bound).speculative_config
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 3)
    # vLLM's older form: the model "ngram" names the method.
    spec = config_of(tiny_model_dirs, {"model": "ngram", "num_speculative_tokens": 2})
    assert spec.speculative_config.method == "ngram"
    assert config_of(tiny_model_dirs, None).speculative_config is None


def test_draft_model_config(tiny_model_dirs):
    values = {"model": tiny_model_dirs["qwen2"], "num_speculative_tokens": 4,
              "disable_by_batch_size": 8}
    config = config_of(tiny_model_dirs, values)
    spec = config.speculative_config
    assert spec.method == "draft_model"  # inferred from "model", as vLLM does
    assert spec.draft_model_config.architecture == "Qwen2ForCausalLM"
    assert spec.num_lookahead_tokens == 4
    assert spec.speculates(8) and not spec.speculates(9)
    # The cache's memory holds the target's and the draft's K/V for the same blocks.
    alone = config_of(tiny_model_dirs, None)
    assert config.cache_config.num_blocks < alone.cache_config.num_blocks


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"num_speculative_tokens": 2}, "needs 'method'"),
        ({"method": "ngram"}, "num_speculative_tokens must be a positive integer"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
          "prompt_lookup_max": 2}, "prompt_lookup_min \\(4\\) must not exceed"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
         "prompt_lookup_min must be a positive integer"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
         "disable_by_batch_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
         "unknown keys \\['draft_tensor_parallel_size'\\]"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "draft_model", "model": "/no/such/model", "num_speculative_tokens": 2},
         "does not exist"),
        ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2,
          "prompt_lookup_max": 3}, "applies to method 'ngram' only"),
    ],
)
def test_bad_settings_are_refused_by_name(tiny_model_dirs, values, message):
    with pytest.raises(ValueError, match=message):
        config_of(tiny_model_dirs, values)


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_model_dirs, default_model_path):
    values = {"method": "draft_model", "model": default_model_path, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary .* differs from the target's"):
        config_of(tiny_model_dirs, values)


def test_llm_takes_speculative_config(tiny_model_dirs):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny_model_dirs["llama"], kv_cache_memory="8MiB",
            speculative_config={"method": "ngram", "num_speculative_tokens": -1})


def test_command_line_flag(capsys):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, positional_model=False)
    namespace = parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    )
    assert engine_args_from(namespace).speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 3,
    }
    for bad in ('{"method": ', '["ngram"]'):
        with pytest.raises(SystemExit):
            parser.parse_args(["--speculative-config", bad])
        assert "--speculative-config must be a JSON object" in capsys.readouterr().err
