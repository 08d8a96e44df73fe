"""On the default model (SmolLM2-135M-Instruct, Q4_1 GGUF), prompts that ask to repeat a
passage: greedy outputs with n-gram and draft-model speculation equal those without, under
chunked prefill, prefix hits and preemption, and the drafts are mostly accepted.

No smaller model of the same family is at hand here: the draft-model case uses the default
model as its own draft, which checks exactness (every draft right: the accepted path and the
draft's cache kept in step), not speed.
"""

from __future__ import annotations

import pytest

from tokenserve.entrypoints.llm import LLM
from tokenserve.sampling_params import SamplingParams

PASSAGE = (
    "The old lighthouse stood at the end of the rocky point, its white paint peeling in long "
    "strips. Every night the keeper climbed the spiral stairs to light the lamp."
)
MAX_TOKENS = 32
# 16-token blocks (the two prompts share whole blocks), 48-token steps (prompts in chunks),
# and a pool that cannot hold both requests as they grow (admission lookahead off): both
# hits and preemptions happen.
SETTINGS = {
    "block_size": 16,
    "num_kv_blocks": 9,
    "max_model_len": 144,
    "max_num_batched_tokens": 48,
    "admission_lookahead_tokens": 0,
}


def generate(default_model_path, speculative_config=None):
    llm = LLM(default_model_path, speculative_config=speculative_config, **SETTINGS)
    messages = [
        [{"role": "user", "content": f"Repeat this passage exactly:\n\n{PASSAGE}"}],
        [{"role": "user", "content": f"Repeat this passage exactly:\n\n{PASSAGE} The end."}],
    ]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.chat(messages, params, use_tqdm=False)
    stats = llm.llm_engine.engine_core.scheduler.make_stats()
    return [o.outputs[0].token_ids for o in outputs], stats


@pytest.fixture(scope="module")
def reference(default_model_path):
    tokens, stats = generate(default_model_path)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    return tokens


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_outputs_equal_those_without_speculation(default_model_path, reference, method):
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                "prompt_lookup_max": 4}
    else:
        spec = {"method": "draft_model", "model": default_model_path,
                "num_speculative_tokens": 3}
    tokens, stats = generate(default_model_path, spec)
    assert tokens == reference
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    spec_stats = stats.spec_decoding_stats
    # Repeating the prompt, most drafts are right.
    assert spec_stats.num_accepted_tokens > spec_stats.num_draft_tokens // 2
