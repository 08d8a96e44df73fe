"""Workload W4 in miniature through the engine on the tiny model: a short request that
arrives while a long prompt is being prefilled gets its first token at once with
prefill_order="shortest", only after the long prompt with "arrival"; greedy outputs equal
transformers' in both orders."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenserve import LLM, SamplingParams

MAX_TOKENS = 8
LONG, SHORT = 200, 10


@pytest.fixture(scope="module")
def prompts(tiny_model_dirs) -> dict[str, list[int]]:
    vocab_size = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"]).config.vocab_size
    rng = random.Random(0)
    return {name: [rng.randrange(3, vocab_size) for _ in range(n)]
            for name, n in (("long", LONG), ("short", SHORT))}


@pytest.fixture(scope="module")
def references(tiny_model_dirs, prompts) -> dict[str, list[int]]:
    path = tiny_model_dirs["llama"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    expected = {}
    for name, prompt in prompts.items():
        generated = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        expected[name] = generated[0, len(prompt):].tolist()
    return expected


@pytest.mark.parametrize("prefill_order", ["shortest", "arrival"])
def test_short_request_beside_a_long_prompt(tiny_model_dirs, prompts, references, prefill_order):
    llm = LLM(tiny_model_dirs["llama"], kv_cache_memory="64MiB", max_num_batched_tokens=32,
              prefill_order=prefill_order)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("long", {"prompt_token_ids": prompts["long"]}, params)
    for _ in range(2):
        engine.step()
    engine.add_request("short", {"prompt_token_ids": prompts["short"]}, params)
    # Steps until "short" has its first token: 1 when it is admitted beside the long prompt;
    # with arrival order, only after the 200-token prompt's remaining 136 tokens (5 steps).
    final: dict[str, list[int]] = {}
    first_token_step = None
    for index in range(1, 100):
        for output in engine.step():
            if output.request_id == "short" and first_token_step is None:
                first_token_step = index
            if output.finished:
                final[output.request_id] = output.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert first_token_step == (1 if prefill_order == "shortest" else 5)
    assert final == references
    assert engine.get_stats().kv_cache_usage == 0.0


def test_long_prefill_token_threshold_spreads_a_prompt_over_steps(
    tiny_model_dirs, prompts, references
):
    """A 200-token prompt under a 48-token threshold takes five steps (48 x 4 + 8) even with
    a budget that holds it whole; the short request beside it is capped too but fits; the
    outputs are transformers'."""
    llm = LLM(tiny_model_dirs["llama"], kv_cache_memory="64MiB", max_num_batched_tokens=256,
              long_prefill_token_threshold=48)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("long", {"prompt_token_ids": prompts["long"]}, params)
    engine.add_request("short", {"prompt_token_ids": prompts["short"]}, params)
    final: dict[str, list[int]] = {}
    first_token_step: dict[str, int] = {}
    for index in range(1, 100):
        for output in engine.step():
            if output.outputs[0].token_ids:
                first_token_step.setdefault(output.request_id, index)
            if output.finished:
                final[output.request_id] = output.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert first_token_step == {"short": 1, "long": 5}
    assert final == references
    assert engine.get_stats().kv_cache_usage == 0.0
