"""Structured outputs with speculation on: each draft position is masked by the grammar as
it stands after the drafts before it, drafts the grammar refuses are never scheduled, and
only sampled tokens move the grammar. Greedy outputs equal those without speculation and
every output (greedy or seeded random) is valid."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenserve.entrypoints.llm import LLM
from tokenserve.sampling_params import SamplingParams, StructuredOutputsParams

REGEX = r"(ab|cd)(-(ab|cd)){6}"
# A JSON object in a fixed layout (a random tiny model under a free JSON schema would pad
# with whitespace until max_tokens).
JSON_REGEX = r'\{"name": "[a-z]{1,8}", "tags": \["(red|green)", "(red|green)", "(red|green)"\]\}'
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "tags": {"type": "array", "items": {"enum": ["red", "green"]},
                            "minItems": 3, "maxItems": 3}},
    "required": ["name", "tags"],
    "additionalProperties": False,
}
PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 120, 250, 8, 9, 10]]


def requests():
    """(structured outputs, check) pairs, each greedy and seeded random."""
    def valid_json(text):
        jsonschema.validate(json.loads(text), SCHEMA)
        return True

    return [
        (StructuredOutputsParams(regex=REGEX), lambda text: re.fullmatch(REGEX, text)),
        (StructuredOutputsParams(regex=JSON_REGEX), valid_json),
        (StructuredOutputsParams(choice=["red-green-red", "green-red-green"]),
         lambda text: text in ("red-green-red", "green-red-green")),
    ]


def run(llm: LLM):
    prompts, params, checks = [], [], []
    for structured, check in requests():
        for prompt in PROMPTS:
            for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3}):
                prompts.append({"prompt_token_ids": prompt})
                params.append(SamplingParams(max_tokens=48, structured_outputs=structured,
                                             **sampling))
                checks.append(check)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for output, check in zip(outputs, checks):
        assert output.finish_reason == "stop", output.text
        assert check(output.text), output.text
    return [(o.token_ids, p.temperature) for o, p in zip(outputs, params)]


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    return run(LLM(tiny_model_dirs["llama"], kv_cache_memory="64MiB"))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_outputs_stay_valid_and_greedy_ones_unchanged(tiny_model_dirs, reference, method):
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3}
    else:
        spec = {"method": "draft_model", "model": tiny_model_dirs["llama"],
                "num_speculative_tokens": 3}
    llm = LLM(tiny_model_dirs["llama"], kv_cache_memory="64MiB", speculative_config=spec)
    outputs = run(llm)
    greedy = [tokens for tokens, temperature in outputs if temperature == 0.0]
    assert greedy == [tokens for tokens, temperature in reference if temperature == 0.0]
    stats = llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding_stats
    assert stats.num_accepted_tokens > 0
