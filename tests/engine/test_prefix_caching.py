"""Automatic prefix caching through the whole engine: hits, what is computed, cache_salt."""

from __future__ import annotations

import random

import pytest

from tokenserve import LLM, SamplingParams
from tokenserve.sampling_params import RequestOutputKind

PREFIX_LEN = 512


@pytest.fixture(scope="module")
def llm(tiny_model_dirs) -> LLM:
    return LLM(tiny_model_dirs["llama"], kv_cache_memory="64MiB")


def run_one(llm: LLM, request_id: str, prompt: list[int], cache_salt: str | None = None):
    """Run one request to completion; return its output and the tokens computed for it."""
    engine = llm.llm_engine
    params = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params, cache_salt=cache_salt)
    computed = 0
    final = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        scheduled = engine.engine_core.last_scheduler_output
        if scheduled is not None:
            computed += scheduled.num_scheduled_tokens.get(request_id, 0)
        final = next((o for o in outputs if o.request_id == request_id), final)
    assert final is not None and final.finished
    return final, computed


def test_shared_prefix_is_computed_once(llm):
    rng = random.Random(1)
    prefix = [rng.randrange(3, 400) for _ in range(PREFIX_LEN)]
    first, first_computed = run_one(llm, "first", prefix + [7, 8, 9])
    # 515 prompt tokens and 4 outputs; the last output is sampled, never computed.
    assert first.num_cached_tokens == 0 and first_computed == PREFIX_LEN + 3 + 3

    second_prompt = prefix + [10, 11, 12, 13, 14]
    second, second_computed = run_one(llm, "second", second_prompt)
    assert second.num_cached_tokens >= PREFIX_LEN - 16
    # Only the part after the cached blocks is computed (plus the decode steps).
    assert second_computed == len(second_prompt) - second.num_cached_tokens + 3

    salted, salted_computed = run_one(llm, "salted", second_prompt, cache_salt="tenant-b")
    assert salted.num_cached_tokens == 0
    assert salted_computed == len(second_prompt) + 3
    assert salted.outputs[0].token_ids == second.outputs[0].token_ids

    # The same salt finds its own earlier blocks.
    again, _ = run_one(llm, "salted-again", second_prompt, cache_salt="tenant-b")
    assert again.num_cached_tokens >= PREFIX_LEN - 16
    assert llm.llm_engine.get_stats().kv_cache_usage == 0.0


def test_prefix_caching_disabled_reports_no_hits(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], kv_cache_memory="16MiB", enable_prefix_caching=False)
    prompt = list(range(3, 3 + 100))
    run_one(llm, "a", prompt)
    output, computed = run_one(llm, "b", prompt)
    assert output.num_cached_tokens == 0 and computed == 100 + 3


def test_chunks_on_a_cached_prefix_take_cascade_attention(tiny_model_dirs, monkeypatch):
    """Requests arriving together on a cached 1,024-token prefix: where SDPA attends prompt
    chunks, their chunks attend to it in one call (cascade attention), with the greedy tokens
    and logprobs of attending chunk by chunk (--disable-cascade-attn). The prompt kernel's
    paths are turned off here: this float32 model's chunks would take its float32 path, which
    attends every chunk over its whole context (no cascade; tests/attention)."""
    from tokenserve.attention.torch_sdpa import TorchSDPABackend

    calls = []
    attend = TorchSDPABackend._attend_cascade

    def counted(self, output, query, key_cache, value_cache, cascade, scale):
        calls.append(len(cascade.rows))
        return attend(self, output, query, key_cache, value_cache, cascade, scale)

    monkeypatch.setattr(TorchSDPABackend, "_attend_cascade", counted)
    rng = random.Random(2)
    prefix = [rng.randrange(3, 400) for _ in range(1024)]
    prompts = [prefix + [rng.randrange(3, 400) for _ in range(20 + 3 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    results = {}
    for disable in (False, True):
        llm = LLM(tiny_model_dirs["llama"], kv_cache_memory="64MiB", disable_cascade_attn=disable)
        (runner,) = llm.llm_engine.collective_rpc(lambda worker: worker.model_runner)
        runner.attention.prompt_paths = ()  # the backend every layer attends with
        run_one(llm, "prefix", prefix + [5])  # caches the prefix's blocks
        calls.clear()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[disable] = outputs
        # The 4 chunks (20, 23, 26 and 29 tokens) in one step: one cascade per layer (2).
        assert calls == ([] if disable else [20 + 23 + 26 + 29] * 2)
    for cascaded, plain in zip(results[False], results[True]):
        assert cascaded.num_cached_tokens == plain.num_cached_tokens == 1024
        assert cascaded.outputs[0].token_ids == plain.outputs[0].token_ids
        for mine, theirs in zip(cascaded.outputs[0].logprobs, plain.outputs[0].logprobs):
            assert mine.keys() == theirs.keys()
            for token, logprob in mine.items():
                assert abs(logprob.logprob - theirs[token].logprob) < 1e-4
