"""Tools over HTTP: tool_choice "required" and a named function on the default model
(calls forced by a JSON schema: their arguments always validate), the tools and earlier
calls reaching the chat template, and the requests that are refused."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.entrypoints.openai.remote_server import TINY_MODEL_NAME
from tests.entrypoints.openai.test_errors import assert_error

DEFAULT_NAME = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time in a timezone", "parameters": TIME},
    },
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]


def streamed_calls(chunks) -> tuple[list[tuple[str, str]], list[str], str]:
    """(name, arguments) per call, joined from the deltas as a client does; the call ids;
    and the finish reason."""
    calls: dict[int, list[str]] = {}
    ids, finish_reasons = [], []
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason:
                finish_reasons.append(choice.finish_reason)
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.type == "function" and call.function.arguments == ""
                    ids.append(call.id)
                    calls[call.index] = [call.function.name, ""]
                else:  # a later delta: only the index and a piece of the arguments
                    assert call.function.name is None and call.type is None
                    calls[call.index][1] += call.function.arguments
    assert len(finish_reasons) == 1
    return [tuple(calls[index]) for index in sorted(calls)], ids, finish_reasons[0]


def assert_calls_validate(calls) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_calls_validate_streamed_and_not(default_server, tool_choice):
    client = default_server.client()
    request = {
        "model": DEFAULT_NAME,
        "messages": QUESTION,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "temperature": 0.0,
        "max_tokens": 60,
    }
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and len({call.id for call in calls}) == len(calls)
    assert_calls_validate(calls)
    if tool_choice != "required":
        assert [call.function.name for call in calls] == ["get_weather"]
    streamed, ids, finish_reason = streamed_calls(
        client.chat.completions.create(**request, stream=True)
    )
    # Greedy: the stream is the same calls, argument text and all.
    assert streamed == [(call.function.name, call.function.arguments) for call in calls]
    assert finish_reason == "tool_calls"
    assert all(i.startswith("chatcmpl-tool-") for i in ids) and len(set(ids)) == len(ids)


# ---- the chat template, and refusals (the session's tiny server: no tool parser) -----

TEMPLATE = (
    "{% for tool in tools or [] %}[tool {{ tool.function.name }} "
    "{{ tool.function.parameters.required | join(',') }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for call in m.tool_calls or [] %}(call {{ call.id }} {{ call.function.name }} "
    "city={{ call.function.arguments.city }}){% endfor %}"
    "{% if m.tool_call_id %}(answers {{ m.tool_call_id }}){% endif %}{% endfor %}"
)
CONVERSATION = [
    *QUESTION,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call-1", "content": "Sunny, 21 C"},
]
RENDERED = (
    "[tool get_weather city,unit][tool get_time timezone]"
    "<user>What is the weather like in Paris?"
    "<assistant>(call call-1 get_weather city=Paris)"
    "<tool>Sunny, 21 C(answers call-1)"
)


def test_tools_and_earlier_calls_reach_the_template(tiny_server, tiny_client):
    body = {"messages": CONVERSATION, "tools": TOOLS, "chat_template": TEMPLATE}
    with tiny_server.http() as http:
        tokens = http.post("/tokenize", json=body).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == RENDERED
    response = tiny_client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=CONVERSATION,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=3,
        extra_body={"chat_template": TEMPLATE},
    )
    assert response.usage.prompt_tokens == len(tokens)
    assert response.choices[0].message.tool_calls == []


@pytest.mark.parametrize(
    ("fields", "param", "problem"),
    [
        ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),  # default: "auto"
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
        ({"tool_choice": "required"}, "tools", "`tools` must be set"),
        ({"tools": [], "tool_choice": "none"}, "tools", "must not be empty"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice", "get_news"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}], "tool_choice": "required"},
            "tools",
            "strnig",
        ),
    ],
)  # fmt: skip
def test_tool_requests_that_cannot_be_served_are_400(tiny_server, fields, param, problem):
    body = {"model": TINY_MODEL_NAME, "messages": QUESTION, "max_tokens": 3, **fields}
    with tiny_server.http() as http:
        error = assert_error(http.post("/v1/chat/completions", json=body), 400)
    assert problem in error["message"] and error["param"] == param
