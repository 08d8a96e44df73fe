"""The multimodal flags: vLLM's `--limit-mm-per-prompt` JSON and the encoder budget reach
the engine configuration; bad values are refused before any weight is read."""

from __future__ import annotations

import argparse

import pytest

from tokenserve.engine.cli_args import add_engine_arguments, engine_args_from
from tokenserve.engine.engine_args import parse_limit_mm_per_prompt


def test_flags_reach_the_engine_config(tiny_llava_dir: str, tiny_model_dirs: dict[str, str]):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, positional_model=True)
    args = engine_args_from(parser.parse_args([
        tiny_llava_dir, "--limit-mm-per-prompt", '{"image": 3}',
        "--max-num-encoder-input-tokens", "100", "--max-num-batched-tokens", "64",
        "--num-kv-blocks", "64", "--block-size", "16", "--max-model-len", "512",
    ]))
    config = args.create_engine_config()
    assert config.model_config.multimodal_config.get_limit_per_prompt("image") == 3
    assert config.scheduler_config.max_num_encoder_input_tokens == 100
    assert config.scheduler_config.encoder_cache_size == 100
    # vLLM's defaults: 999 images, the step's token budget for the encoder.
    args.limit_mm_per_prompt = None
    args.max_num_encoder_input_tokens = None
    config = args.create_engine_config()
    assert config.model_config.multimodal_config.get_limit_per_prompt("image") == 999
    assert config.scheduler_config.max_num_encoder_input_tokens == 64
    # The language model's shape comes from the text config.
    assert config.model_config.num_layers == 2 and config.model_config.vocab_size > 500
    args.model = tiny_model_dirs["llama"]
    assert args.create_engine_config().model_config.multimodal_config is None


@pytest.mark.parametrize(
    "value, match",
    [
        ("{image: 2}", "JSON"),
        ('["image"]', "map modalities"),
        ('{"video": 1}', "unsupported modality"),
        ('{"image": -1}', "non-negative"),
        ('{"image": true}', "non-negative"),
    ],
)
def test_bad_limits_are_value_errors(value: str, match: str):
    with pytest.raises(ValueError, match=match):
        parse_limit_mm_per_prompt(value)
