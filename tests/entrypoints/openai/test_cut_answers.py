"""Issue 25's two answers that broke clients, over HTTP on the default model: a forced
tool call cut by max_tokens (the same message streamed or not; LangChain gets its tool
call), and max_tokens ending inside a multi-byte character (no U+FFFD, streamed or not)."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.test_tool_choice import (
    DEFAULT_NAME,
    QUESTION,
    TOOLS,
    WEATHER,
    streamed_calls,
)

NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
@pytest.mark.parametrize("max_tokens", [6])  # the issue's
def test_forced_call_cut_by_max_tokens_same_streamed_and_not(
    default_server, tool_choice, max_tokens
):
    client = default_server.client()
    request = {
        "model": DEFAULT_NAME,
        "messages": QUESTION,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "temperature": 0.0,
        "max_tokens": max_tokens,
    }
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None  # never the raw constrained JSON
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert not any(c.delta.content for chunk in chunks for c in chunk.choices)
    streamed, _, finish_reason = streamed_calls(chunks)
    assert streamed == calls and finish_reason == "length"
    if tool_choice == NAMED:
        # A named choice always answers with its call: the arguments as generated so far.
        [(name, arguments)] = calls
        assert name == "get_weather" and arguments and not arguments.endswith("}")


def test_langchain_bind_tools_with_a_named_choice_gets_the_call(default_server):
    from langchain_core.tools import StructuredTool
    from langchain_openai import ChatOpenAI

    def get_weather(city: str, unit: str) -> str:
        """The weather in a city"""
        return f"Sunny in {city}"

    tool = StructuredTool.from_function(get_weather, args_schema=WEATHER)
    model = ChatOpenAI(
        base_url=f"{default_server.url}/v1",
        api_key="none",
        model=DEFAULT_NAME,
        temperature=0.0,
        max_tokens=60,
        max_retries=0,
    ).bind_tools([tool], tool_choice="get_weather")
    message = model.invoke(QUESTION[0]["content"])
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    assert not message.invalid_tool_calls


EMOJI_PROMPT = [{"role": "user", "content": "Repeat exactly: 🎉🚀 naïve café 日本語 😀"}]


@pytest.mark.parametrize("max_tokens", [40])  # 38 and 41 offline: tests/engine
def test_no_replacement_character_when_max_tokens_cuts_a_character(default_server, max_tokens):
    client = default_server.client()
    request = {
        "model": DEFAULT_NAME,
        "messages": EMOJI_PROMPT,
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "logprobs": True,
    }
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "length" and "\ufffd" not in choice.message.content
    # The cut is real: the last token is a piece of a character.
    assert choice.logprobs.content[-1].token.endswith("\ufffd")
    stream = client.chat.completions.create(**request, stream=True)
    streamed = "".join(c.delta.content or "" for chunk in stream for c in chunk.choices)
    assert streamed == choice.message.content
