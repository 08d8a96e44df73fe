"""Structured outputs over HTTP: response_format, vLLM's structured_outputs and guided_*
fields, on the default model (SmolLM2) and the session's tiny one; bad specs are a 400
before the engine sees them.
Also which constraint a request gets (unit): one field at most, and with a reasoning
parser, only after the reasoning."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest

from tests.entrypoints.openai.remote_server import TINY_MODEL_NAME
from tests.entrypoints.openai.test_errors import assert_error
from tokenserve.entrypoints.openai.assistant_message import ChatParsing
from tokenserve.entrypoints.openai.errors import OpenAIError
from tokenserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenserve.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenserve.entrypoints.openai.structured_outputs import requested_structured_outputs

DEFAULT_NAME = "SmolLM2-135M-Instruct"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "temperature_c": {"type": "integer", "minimum": -50, "maximum": 60},
    },
    "required": ["city", "temperature_c"],
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]


# ---- which constraint a request gets ------------------------------------------------


def completion_request(**fields) -> CompletionRequest:
    return CompletionRequest(prompt="Hi", **fields)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER_SCHEMA}}},
            {"json": WEATHER_SCHEMA},
        ),
        ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
        (
            {"structured_outputs": {"json": WEATHER_SCHEMA, "disable_any_whitespace": True}},
            {"json": WEATHER_SCHEMA, "disable_any_whitespace": True},
        ),
        ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ({"guided_json": WEATHER_SCHEMA}, {"json": WEATHER_SCHEMA}),
    ],
)  # fmt: skip
def test_the_fields_that_ask_for_a_constraint(fields, expected):
    structured = requested_structured_outputs(completion_request(**fields))
    if expected is None:
        assert structured is None
    else:
        for name, value in expected.items():
            assert getattr(structured, name) == value
        assert structured.enforce_after_token_ids is None


@pytest.mark.parametrize(
    ("fields", "param", "problem"),
    [
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "at most one",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "exactly one"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "Invalid regex"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ],
)  # fmt: skip
def test_conflicting_or_invalid_constraints_are_400(fields, param, problem):
    with pytest.raises(OpenAIError, match=problem) as raised:
        requested_structured_outputs(completion_request(**fields))
    assert raised.value.status == 400 and raised.value.param == param


def serving_chat(tokenizer, **flags) -> OpenAIServingChat:
    config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=1024),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        parallel_config=SimpleNamespace(data_parallel_size=1),
    )
    engine = SimpleNamespace(tokenizer=tokenizer, config=config)
    return OpenAIServingChat(engine, ["tiny"], parsing=ChatParsing(**flags))  # type: ignore[arg-type]


def test_with_a_reasoning_parser_the_grammar_starts_after_the_reasoning(tiny_tokenizer):
    end_ids = tiny_tokenizer.encode("</think>", add_special_tokens=False)
    request = ChatCompletionRequest(
        messages=WEATHER_QUESTION, structured_outputs={"regex": "[a-z]+"}
    )
    chat = serving_chat(tiny_tokenizer, reasoning_parser="deepseek_r1")
    structured = chat.structured_outputs(request, "none", reasoning_ended=False)
    assert structured.regex == "[a-z]+" and structured.enforce_after_token_ids == end_ids
    # Tool calls forced by tool_choice are constrained after the reasoning too.
    tools = [{"type": "function", "function": {"name": "f", "parameters": WEATHER_SCHEMA}}]
    forced = ChatCompletionRequest(messages=WEATHER_QUESTION, tools=tools, tool_choice="required")
    forced_structured = chat.structured_outputs(forced, "required", reasoning_ended=False)
    assert forced_structured.enforce_after_token_ids == end_ids
    # From the first token: the prompt closed the reasoning, the server constrains the
    # reasoning too, or there is no reasoning parser.
    assert (
        chat.structured_outputs(request, "none", reasoning_ended=True).enforce_after_token_ids
        is None
    )
    in_reasoning = serving_chat(
        tiny_tokenizer, reasoning_parser="deepseek_r1", structured_outputs_in_reasoning=True
    )
    assert in_reasoning.structured_outputs(request, "none", False).enforce_after_token_ids is None
    assert (
        serving_chat(tiny_tokenizer)
        .structured_outputs(request, "none", False)
        .enforce_after_token_ids
        is None
    )


# ---- over HTTP, on the default model -------------------------------------------------


def test_response_format_json_schema(default_server):
    choice = (
        default_server.client()
        .chat.completions.create(
            model=DEFAULT_NAME,
            messages=WEATHER_QUESTION,
            temperature=0.0,
            max_tokens=80,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA, "strict": True},
            },
        )
        .choices[0]
    )
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), WEATHER_SCHEMA)


def test_response_format_json_object(default_server):
    choice = (
        default_server.client()
        .chat.completions.create(
            model=DEFAULT_NAME,
            messages=[
                {"role": "user", "content": 'Give a JSON object with the key "capital" for France.'}
            ],
            temperature=0.0,
            max_tokens=60,
            response_format={"type": "json_object"},
        )
        .choices[0]
    )
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


def test_structured_outputs_regex_choice_and_guided_choice_on_completions(tiny_client):
    # The session's tiny random model: what it writes is the grammar's doing alone.
    year = tiny_client.completions.create(
        model=TINY_MODEL_NAME,
        prompt="The Eiffel Tower was finished in the year",
        temperature=0.0,
        max_tokens=10,
        extra_body={"structured_outputs": {"regex": " ?[12][0-9]{3}"}},
    ).choices[0]
    assert re.fullmatch(r" ?[12][0-9]{3}", year.text) and year.finish_reason == "stop"
    answers = [
        tiny_client.completions.create(
            model=TINY_MODEL_NAME,
            prompt="Is the sky blue? Answer:",
            temperature=0.0,
            max_tokens=5,
            extra_body=field,
        )
        .choices[0]
        .text
        for field in (
            {"structured_outputs": {"choice": ["yes", "no", "maybe not"]}},
            {"guided_choice": ["yes", "no", "maybe not"]},
        )
    ]
    assert answers[0] in ("yes", "no", "maybe not") and answers[1] == answers[0]


@pytest.mark.parametrize(
    ("path", "body", "param", "problem"),
    [
        (
            "/v1/chat/completions",
            {
                "messages": WEATHER_QUESTION,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 5, "maxLength": 2}},
                },
            },
            "response_format",
            "minLength 5 is greater than maxLength 2",
        ),
        (
            "/v1/chat/completions",
            {"messages": WEATHER_QUESTION, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
            "response_format",
            "strnig",
        ),
        ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"regex": "(\\d{4}"}}, "structured_outputs", "parenthesis is not closed"),
        ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs", "undefined_rule"),
        ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"regexp": "a"}}, "structured_outputs", "regexp"),
        ("/v1/completions", {"prompt": "Hi", "guided_json": '{"type": "object",'}, "guided_json", "not valid JSON"),
    ],
)  # fmt: skip
def test_invalid_specs_are_400_naming_the_problem(default_server, path, body, param, problem):
    with default_server.http() as http:
        error = assert_error(http.post(path, json={**body, "max_tokens": 5}), 400)
    assert problem in error["message"] and error["param"] == param


def test_server_serves_after_refusing_specs(default_server):
    with default_server.http() as http:
        bad = {"prompt": "Hi", "max_tokens": 5, "structured_outputs": {"regex": "["}}
        assert http.post("/v1/completions", json=bad).status_code == 400
        good = {"prompt": "Hi", "max_tokens": 5, "structured_outputs": {"regex": "[a-z]{3}"}}
        response = http.post("/v1/completions", json=good)
        assert response.status_code == 200
        assert re.fullmatch("[a-z]{3}", response.json()["choices"][0]["text"])
        assert http.get("/health").status_code == 200
