"""One choice's output → reasoning, content and tool calls: whole, and streamed as deltas."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.parser_streams import every_cut, token_pieces
from tokenserve.entrypoints.openai.assistant_message import AssistantMessageParser, ChatParsing
from tokenserve.entrypoints.openai.protocol import (
    ChatCompletionNamedToolChoiceParam,
    DeltaMessage,
    NamedFunction,
)
from tokenserve.entrypoints.openai.reasoning_parsers import DeepSeekR1ReasoningParser
from tokenserve.entrypoints.openai.tool_parsers import FunctionCallText
from tokenserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser

OUTPUT = (
    "<think>The user asks for the weather; I have a tool.</think>Checking.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def reasoning_and_hermes() -> AssistantMessageParser:
    return AssistantMessageParser(DeepSeekR1ReasoningParser(), HermesToolParser())


def stream(parser: AssistantMessageParser, chunks: list[str]) -> list[DeltaMessage]:
    deltas = [delta for chunk in chunks for delta in parser.feed(chunk)]
    return deltas + parser.finish()


def joined(deltas: list[DeltaMessage]) -> dict:
    """The deltas put together the way a client does."""
    message: dict = {"reasoning_content": "", "content": "", "tool_calls": {}}
    for delta in deltas:
        message["reasoning_content"] += delta.reasoning_content or ""
        message["content"] += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                message["tool_calls"][call.index] = [call.function.name, ""]
            message["tool_calls"][call.index][1] += call.function.arguments
    return message


def test_reasoning_then_content_then_a_call():
    parser = reasoning_and_hermes()
    message = parser.parse(OUTPUT)
    assert message.reasoning_content == "The user asks for the weather; I have a tool."
    assert message.content == "Checking.\n"
    assert message.tool_calls == [FunctionCallText("get_weather", '{"city": "Paris"}')]
    assert parser.tools_called


def test_streamed_deltas_join_to_the_whole_message(tiny_tokenizer):
    cuts = [token_pieces(tiny_tokenizer, OUTPUT), *every_cut(OUTPUT)]
    for chunks in cuts:
        parser = reasoning_and_hermes()
        deltas = stream(parser, chunks)
        assert joined(deltas) == {
            "reasoning_content": "The user asks for the weather; I have a tool.",
            "content": "Checking.\n",
            "tool_calls": {0: ["get_weather", '{"city": "Paris"}']},
        }, len(chunks)
        assert parser.tools_called


def test_delta_shapes(tiny_tokenizer):
    deltas = stream(reasoning_and_hermes(), token_pieces(tiny_tokenizer, OUTPUT))
    dumped = [json.loads(delta.model_dump_json()) for delta in deltas]
    calls = [d["tool_calls"] for d in dumped if "tool_calls" in d]
    assert all(len(call) == 1 for call in calls)
    first, *rest = [call[0] for call in calls]
    assert first["id"].startswith("chatcmpl-tool-") and len(first["id"]) > 20
    assert first == {
        "index": 0,
        "id": first["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert len(rest) > 2 and all(set(call) == {"index", "function"} for call in rest)
    assert all(set(call["function"]) == {"arguments"} for call in rest)
    # Nothing a delta does not carry is sent (no nulls), and no delta is empty.
    assert all(dumped) and not any(None in d.values() for d in dumped)


def test_without_parsers_every_delta_is_content_as_it_is():
    parser = AssistantMessageParser()
    assert parser.parse("<think>x</think><tool_call>").content == "<think>x</think><tool_call>"
    assert parser.feed("") == [DeltaMessage(content="")]
    assert parser.feed("<think>") == [DeltaMessage(content="<think>")]
    assert parser.finish() == []


def test_no_tool_calls_while_the_model_is_still_reasoning():
    named = ChatCompletionNamedToolChoiceParam(function=NamedFunction(name="get_weather"))
    parsing = ChatParsing(reasoning_parser="deepseek_r1")
    parser = parsing.new_message_parser(named, reasoning_ended=False)
    message = parser.parse("Still thinking about the city")
    assert message.tool_calls == [] and message.content is None
    assert stream(parsing.new_message_parser(named, False), ["Still ", "thinking"]) == [
        DeltaMessage(reasoning_content="Still "),
        DeltaMessage(reasoning_content="thinking"),
    ]
    after = parsing.new_message_parser(named, reasoning_ended=True).parse('{"city": "Paris"}')
    assert after.tool_calls == [FunctionCallText("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        ({"tool_call_parser": "mistral"}, "Unknown tool call parser"),
        ({"reasoning_parser": "granite"}, "Unknown reasoning parser"),
        ({"enable_auto_tool_choice": True}, "--tool-call-parser"),
    ],
)
def test_bad_server_flags_are_refused(flags, problem):
    with pytest.raises(ValueError, match=problem):
        ChatParsing(**flags)
