"""Structured outputs on the default model (SmolLM2-135M-Instruct), greedy, end to end:
every output follows its JSON schema, regex, choice or grammar; bad specs are refused
before they reach the engine; constrained rows leave the other rows' tokens alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.structured_output.schemas import SCHEMA_CASES
from tokenserve import LLM, SamplingParams, StructuredOutputsParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory="256MiB")


def greedy(structured: StructuredOutputsParams | None = None, max_tokens: int = 200):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=structured)


def chat(llm: LLM, prompts: list[str], params: list[SamplingParams]):
    conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
    return [output.outputs[0] for output in llm.chat(conversations, params, use_tqdm=False)]


def test_twenty_json_schemas_validate(llm):
    # Half with compact JSON (no free whitespace), half allowing any whitespace.
    params = [
        greedy(StructuredOutputsParams(json=schema, disable_any_whitespace=i % 2 == 1))
        for i, (_, schema) in enumerate(SCHEMA_CASES)
    ]
    outputs = chat(llm, [prompt for prompt, _ in SCHEMA_CASES], params)
    for (prompt, schema), output in zip(SCHEMA_CASES, outputs):
        assert output.finish_reason == "stop", (prompt, output.text)
        jsonschema.validate(
            json.loads(output.text), schema, format_checker=jsonschema.FormatChecker()
        )


EXPRESSION_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= number | "(" expr ")"
number ::= [1-9] [0-9]{0,2}
"""
EXPRESSION_RE = r"(\(|\)|[1-9][0-9]{0,2}|[+-])+"

SENTENCE_LARK = r"""
start: subject " " verb " " object "."
subject: "The cat" | "A dog" | "My friend"
verb: "eats" | "likes" | "sees"
object: /[a-z]{2,12}/
"""
SENTENCE_RE = r"(The cat|A dog|My friend) (eats|likes|sees) [a-z]{2,12}\."


def test_regex_choice_grammar_and_json_object(llm):
    cases = [
        ("When was the Eiffel Tower finished? Give the date.", dict(regex=r"\d{4}-\d{2}-\d{2}")),
        ("Give me a US phone number.", dict(regex=r"\(\d{3}\) \d{3}-\d{4}")),
        ("Is the sky blue? Answer yes or no.", dict(choice=["yes", "no"])),
        ("Which is a fruit?", dict(choice=["carrot", "apple pie", "banana", "rock"])),
        ("Write an arithmetic expression.", dict(grammar=EXPRESSION_EBNF)),
        ("Write a short sentence about an animal.", dict(grammar=SENTENCE_LARK)),
        (
            'Return a JSON object with one key, "answer", holding the capital of France.',
            dict(json_object=True, disable_any_whitespace=True),
        ),
    ]
    params = [greedy(StructuredOutputsParams(**spec), max_tokens=120) for _, spec in cases]
    outputs = chat(llm, [prompt for prompt, _ in cases], params)
    for (prompt, spec), output in zip(cases, outputs):
        assert output.finish_reason == "stop", (prompt, output.text)
    texts = [output.text for output in outputs]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", texts[0])
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", texts[1])
    assert texts[2] in ("yes", "no")
    assert texts[3] in ("carrot", "apple pie", "banana", "rock")
    assert re.fullmatch(EXPRESSION_RE, texts[4]) and texts[4].count("(") == texts[4].count(")")
    assert re.fullmatch(SENTENCE_RE, texts[5])
    assert isinstance(json.loads(texts[6]), dict)


def test_free_rows_are_untouched_by_constrained_rows(llm):
    free_prompts = ["Tell me about the ocean.", "What is a good breakfast?", "Name a planet."]
    free_params = [greedy(max_tokens=24) for _ in free_prompts]
    alone = chat(llm, free_prompts, free_params)

    constrained_prompts = ["Describe a person as JSON.", "Is water wet?", "Give a year."]
    constrained_params = [
        greedy(StructuredOutputsParams(json=SCHEMA_CASES[0][1]), max_tokens=24),
        greedy(StructuredOutputsParams(choice=["yes", "no"]), max_tokens=24),
        greedy(StructuredOutputsParams(regex=r"[12][0-9]{3}"), max_tokens=24),
    ]
    # Interleaved, so constrained and free rows alternate in every step's batch.
    prompts = [p for pair in zip(free_prompts, constrained_prompts) for p in pair]
    params = [p for pair in zip(free_params, constrained_params) for p in pair]
    mixed = chat(llm, prompts, params)
    assert [o.token_ids for o in mixed[0::2]] == [o.token_ids for o in alone]
    assert mixed[3].text in ("yes", "no")
    assert re.fullmatch(r"[12][0-9]{3}", mixed[5].text)


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (dict(json={"type": "object", "properties": {"a": {"type": "strnig"}}}), "strnig"),
        (dict(json={"type": "string", "minLength": 5, "maxLength": 2}), "minLength"),
        (dict(json={"$ref": "#/$defs/missing"}), "missing"),
        (dict(json='{"type": "object",'), "not valid JSON"),
        (dict(regex=r"(\d{4}"), "regex"),
        (dict(regex=r"a{3,1}"), "regex"),
        (dict(grammar="start: item+\nitem: undefined_rule"), "undefined_rule"),
        (dict(grammar='root ::= "a" |'), "grammar"),
        (dict(choice=[]), "choice"),
        (dict(regex="a", choice=["a"]), "exactly one"),
    ],
)
def test_invalid_specs_are_refused_with_the_problem_named(llm, spec, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        llm.generate(["Hello"], greedy(StructuredOutputsParams(**spec)), use_tqdm=False)


def test_engine_serves_normally_after_refusals(llm):
    with pytest.raises(ValueError):
        llm.generate(
            ["a", "b"],
            [
                greedy(StructuredOutputsParams(regex="[0-9]")),
                greedy(StructuredOutputsParams(regex="(")),
            ],
            use_tqdm=False,
        )
    [output] = llm.generate(["The capital of France is"], greedy(max_tokens=4), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4
    stats = llm.llm_engine.get_stats()
    assert stats.num_waiting_reqs == stats.num_running_reqs == 0
    assert stats.kv_cache_usage == 0.0
