"""Speculative decoding never changes greedy outputs: with n-gram and draft-model proposals,
under chunked prefill, prefix-cache hits and preemption, every request's tokens equal those
of the same engine without speculation (which tests/engine/test_correctness.py holds equal
to transformers), and drafts were proposed and accepted along the way."""

from __future__ import annotations

import random

import pytest

from tokenserve.entrypoints.llm import LLM
from tokenserve.sampling_params import SamplingParams

MAX_TOKENS = 24
# 16-token blocks, 32-token steps (prompts in chunks), a pool too small for every request at
# once and no admission lookahead: preemptions happen.
SETTINGS = {
    "block_size": 16,
    "num_kv_blocks": 16,
    "max_num_batched_tokens": 32,
    "max_model_len": 256,
    "admission_lookahead_tokens": 0,
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 400) for _ in range(48)]  # three whole blocks to hit
    phrase = [rng.randrange(3, 400) for _ in range(6)]
    result = [shared + [5, 6, 7], shared + [8, 9]]
    # Prompts that repeat themselves, so the n-gram lookup finds its suffix in them.
    result += [phrase * 5, [rng.randrange(3, 400) for _ in range(20)] + phrase * 3]
    result += [[rng.randrange(3, 400) for _ in range(n)] for n in (3, 40, 70)]
    return result


def generate(model: str, prompts, speculative_config=None):
    llm = LLM(model, speculative_config=speculative_config, **SETTINGS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    scheduler = llm.llm_engine.engine_core.scheduler
    stats = scheduler.make_stats()
    assert not scheduler.kv_cache_manager.req_to_blocks  # every block given back
    return [o.outputs[0].token_ids for o in outputs], stats


@pytest.fixture(scope="module")
def reference(tiny_model_dirs, prompts):
    tokens, stats = generate(tiny_model_dirs["llama"], prompts)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    return tokens


@pytest.mark.parametrize(
    "method",
    ["ngram", "draft_model_self", "draft_model_other"],
)
def test_greedy_outputs_equal_those_without_speculation(tiny_model_dirs, prompts, reference,
                                                        method):
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3}
    else:
        # The target as its own draft (every draft right) or another tiny model with the
        # same tokenizer (mostly wrong drafts).
        draft = tiny_model_dirs["llama" if method == "draft_model_self" else "qwen2"]
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    tokens, stats = generate(tiny_model_dirs["llama"], prompts, spec)
    assert tokens == reference
    spec_stats = stats.spec_decoding_stats
    assert spec_stats.num_drafts > 0 and stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    # (A random tiny model seldom repeats its prompt: n-gram drafts are accepted on the
    # default model, test_default_model.py.)
    if method == "draft_model_self":
        assert spec_stats.num_accepted_tokens == spec_stats.num_draft_tokens
    assert sum(spec_stats.num_accepted_tokens_per_pos) == spec_stats.num_accepted_tokens


def test_disable_by_batch_size_turns_speculation_off_for_large_batches(tiny_model_dirs, prompts,
                                                                      reference):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "disable_by_batch_size": 1}
    llm = LLM(tiny_model_dirs["llama"], speculative_config=spec, **SETTINGS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    steps = []
    engine_core = llm.llm_engine.engine_core
    schedule = engine_core.scheduler.schedule

    def recording_schedule():
        output = schedule()
        steps.append((len(engine_core.scheduler.running), bool(output.scheduled_spec_decode_tokens)))
        return output

    engine_core.scheduler.schedule = recording_schedule
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert not any(drafts for running, drafts in steps if running > 1)
    assert any(drafts for running, drafts in steps if running == 1)
