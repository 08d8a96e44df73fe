"""Idefics3 (SmolVLM's architecture), offline: image splitting into tiles, pixel shuffle and
the connector give transformers' greedy tokens, for one and two images of different sizes
and with the prompt (and the tags between an image's tiles) split across chunks."""

from __future__ import annotations

import pytest

from tests.multimodal.conftest import hf_generate, random_image
from tokenserve.entrypoints.llm import LLM
from tokenserve.sampling_params import SamplingParams

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = {"block_size": 16, "num_kv_blocks": 64, "max_model_len": 512}


@pytest.mark.parametrize("max_num_batched_tokens", [None, 8], ids=["whole", "chunked"])
def test_matches_transformers(tiny_idefics3_dir: str, max_num_batched_tokens: int | None):
    llm = LLM(tiny_idefics3_dir, max_num_batched_tokens=max_num_batched_tokens, **ENGINE)
    cases = [
        ("Hello <image> what is this?", [random_image(1)]),
        # A 40×52 image is split into 2×2 tiles, a 12×10 one is not.
        ("<image> or <image>: which one?", [random_image(2), random_image(3, (12, 10))]),
    ]
    for prompt, images in cases:
        expected_prompt, expected = hf_generate(tiny_idefics3_dir, prompt, images, MAX_TOKENS)
        [output] = llm.generate(
            {"prompt": prompt, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False
        )
        assert output.prompt_token_ids == expected_prompt
        assert output.outputs[0].token_ids == expected
