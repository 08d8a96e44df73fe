"""Qwen3: greedy generation equals transformers' token for token; as a Qwen3-Embedding style
pooling model its embeddings equal sentence-transformers' (last token and mean, fp32, 1e-5),
whether the prompt is computed in one step, in chunks, or after a prefix-cache hit; a
matryoshka model's `dimensions` shorten the embedding before it is normalized."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.conftest import write_tiny_tokenizer
from tests.pooling_models import build_qwen3_st_dir, qwen3_config
from tokenserve.entrypoints.llm import LLM
from tokenserve.pooling_params import PoolingParams
from tokenserve.sampling_params import SamplingParams

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    (
        "Once upon a time there was a small village at the edge of a great forest. Every "
        "morning the baker opened his shop, and the children walked to school."
    ),
]
# 16-token blocks and budget: the long prompt takes several chunks, and its full blocks can
# be served from the prefix cache on a second request.
CHUNKED = {"num_kv_blocks": 32, "block_size": 16, "max_num_batched_tokens": 16}


def test_generation_equals_transformers(tmp_path):
    tokenizer = write_tiny_tokenizer(tmp_path)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        model = transformers.Qwen3ForCausalLM(qwen3_config(len(tokenizer))).eval()
    model.save_pretrained(str(tmp_path))
    prompts = [tokenizer.encode(text) for text in TEXTS]
    llm = LLM(str(tmp_path), num_kv_blocks=32, block_size=16)
    assert llm.llm_engine.config.model_config.runner == "generate"
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )[0, len(prompt):]
        assert output.outputs[0].token_ids == expected.tolist()


@pytest.mark.parametrize("pooling_mode", ["lasttoken", "mean"])
def test_embeddings_equal_sentence_transformers_across_chunks(tmp_path, pooling_mode):
    reference = build_qwen3_st_dir(tmp_path, pooling_mode)
    expected = reference.encode(TEXTS, convert_to_tensor=True)
    whole = LLM(str(tmp_path / "st"), num_kv_blocks=32, block_size=16)
    chunked = LLM(str(tmp_path / "st"), **CHUNKED)
    assert chunked.llm_engine.config.model_config.runner == "pooling"  # Qwen3Model pools
    for llm in (whole, chunked):
        outputs = llm.embed(TEXTS, use_tqdm=False)
        got = torch.tensor([output.outputs.embedding for output in outputs])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert len(outputs[1].prompt_token_ids) > 2 * CHUNKED["max_num_batched_tokens"]

    # Again: last-token pooling reuses the cached prefix; mean pooling computes it all.
    again = chunked.embed(TEXTS[1], use_tqdm=False)[0]
    if pooling_mode == "lasttoken":
        assert again.num_cached_tokens >= 32
    else:
        assert again.num_cached_tokens == 0
    torch.testing.assert_close(
        torch.tensor(again.outputs.embedding), expected[1], atol=1e-5, rtol=0
    )


def test_matryoshka_dimensions(tmp_path):
    reference = build_qwen3_st_dir(tmp_path, "lasttoken", is_matryoshka=True)
    llm = LLM(str(tmp_path / "st"), num_kv_blocks=32, block_size=16)
    pooled = reference.encode(TEXTS, convert_to_tensor=True, normalize_embeddings=False)
    outputs = llm.embed(TEXTS, PoolingParams(dimensions=16), use_tqdm=False)
    got = torch.tensor([output.outputs.embedding for output in outputs])
    # The reference's Normalize module ran before; the first 16 of the pooled vector, renormalized.
    torch.testing.assert_close(got, F.normalize(pooled[:, :16], dim=-1), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="at most the model's hidden size 64"):
        llm.embed(TEXTS, PoolingParams(dimensions=65), use_tqdm=False)


def test_dimensions_refused_without_matryoshka(tmp_path):
    build_qwen3_st_dir(tmp_path, "lasttoken")
    llm = LLM(str(tmp_path / "st"), num_kv_blocks=32, block_size=16)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        llm.embed(TEXTS, PoolingParams(dimensions=16), use_tqdm=False)
    with pytest.raises(ValueError, match="does not generate text"):
        llm.generate(TEXTS[0], use_tqdm=False)
