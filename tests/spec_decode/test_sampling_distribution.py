"""With temperature 1, speculative decoding leaves the distribution of the sampled tokens as
it is: the first three tokens of many seeded requests, with n-gram or draft-model
proposals, fit the exact distribution the model gives without speculation.

That distribution is computed from transformers' logits with the same per-position
sampling parameters (allowed tokens, logit bias, presence and frequency penalties over the
output so far). Chi-square goodness of fit, p-value threshold 1e-3: an exact sampler fails
it with probability 0.001 (the false-alarm rate); each request is seeded (seed = its index),
so every run draws the same samples and the outcome is deterministic anyway. The same test
on the engine without speculation checks the reference itself.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from tokenserve.entrypoints.llm import LLM
from tokenserve.sampling_params import SamplingParams

P_VALUE_THRESHOLD = 1e-3
NUM_SAMPLES = 1000
ALLOWED = [10, 20, 30, 40]
LOGIT_BIAS = {10: 1.0, 20: 0.5}
PRESENCE, FREQUENCY = 0.5, 0.3
# The prompt repeats the allowed tokens: the n-gram lookup always finds a continuation.
PROMPT = ALLOWED * 3 + [10, 20]
NUM_TOKENS = 3  # the tokens whose joint distribution is tested (4^3 cells)


def params(seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=NUM_TOKENS + 1, ignore_eos=True,
        allowed_token_ids=ALLOWED, logit_bias=LOGIT_BIAS,
        presence_penalty=PRESENCE, frequency_penalty=FREQUENCY,
    )


@pytest.fixture(scope="module")
def exact(tiny_model_dirs) -> dict[tuple[int, ...], float]:
    """P(first three tokens) without speculation, from the model's logits."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32)

    def next_token_probs(output: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(output)])).logits[0, -1].double()
        allowed = logits[ALLOWED].clone()
        for index, token in enumerate(ALLOWED):
            count = output.count(token)
            allowed[index] += LOGIT_BIAS.get(token, 0.0) - FREQUENCY * count
            allowed[index] -= PRESENCE * (count > 0)
        return allowed.softmax(dim=0)

    probs = {}
    for tokens in itertools.product(ALLOWED, repeat=NUM_TOKENS):
        p = 1.0
        for length in range(NUM_TOKENS):
            p *= float(next_token_probs(tokens[:length])[ALLOWED.index(tokens[length])])
        probs[tokens] = p
    assert abs(sum(probs.values()) - 1.0) < 1e-9
    return probs


def p_value(llm: LLM, exact: dict[tuple[int, ...], float]) -> float:
    prompts = [{"prompt_token_ids": PROMPT}] * NUM_SAMPLES
    outputs = llm.generate(prompts, [params(seed) for seed in range(NUM_SAMPLES)], use_tqdm=False)
    counts = Counter(tuple(o.outputs[0].token_ids[:NUM_TOKENS]) for o in outputs)
    cells = sorted(exact, key=exact.get, reverse=True)
    observed = np.array([counts[cell] for cell in cells], dtype=float)
    expected = np.array([exact[cell] * NUM_SAMPLES for cell in cells])
    # Cells expected fewer than 5 times are pooled (chi-square's usual validity rule).
    keep = expected >= 5
    observed = np.append(observed[keep], observed[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
    return float(chisquare(observed, expected).pvalue)


@pytest.mark.parametrize("method", [None, "ngram", "draft_model"])
def test_sampled_tokens_keep_their_distribution(tiny_model_dirs, exact, method):
    spec = None
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                "prompt_lookup_max": 2}
    elif method == "draft_model":
        # The draft draws from its own distribution (another tiny model, temperature 1):
        # accepted with min(1, p / q), else the residual.
        spec = {"method": "draft_model", "model": tiny_model_dirs["mistral"],
                "num_speculative_tokens": 2}
    llm = LLM(tiny_model_dirs["llama"], kv_cache_memory="64MiB", max_num_seqs=256,
              speculative_config=spec)
    assert p_value(llm, exact) > P_VALUE_THRESHOLD
    stats = llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding_stats
    if method is not None:
        assert stats.num_draft_tokens > 0
    if method == "ngram":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both paths taken
