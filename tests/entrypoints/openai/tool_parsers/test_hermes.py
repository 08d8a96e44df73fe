"""The hermes tool-call parser: whole outputs, and the same outputs streamed in pieces."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.parser_streams import every_cut, feed_all, token_pieces
from tokenserve.entrypoints.openai.tool_parsers import FunctionCallText
from tokenserve.entrypoints.openai.tool_parsers.abstract import join_call_deltas
from tokenserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser

TWO_CALLS = (
    "Let me look that up.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
    '<tool_call>\n{"arguments": {"timezone": "Europe/Paris"}, "name": "get_time"}\n</tool_call>'
)
EXPECTED_CALLS = [
    FunctionCallText("get_weather", '{"city": "Paris", "days": 3}'),
    FunctionCallText("get_time", '{"timezone": "Europe/Paris"}'),
]


def test_calls_and_the_content_before_them():
    extracted = HermesToolParser().extract(TWO_CALLS)
    assert extracted.calls == EXPECTED_CALLS
    assert extracted.content == "Let me look that up.\n"
    assert json.loads(extracted.calls[0].arguments) == {"city": "Paris", "days": 3}


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is sunny.",
        "Use <b>bold</b> and a < b, or <tool_cal and <tool_calls>.",
        "",
    ],
)
def test_text_without_calls_is_content(text):
    extracted = HermesToolParser().extract(text)
    assert extracted.calls == []
    assert extracted.content == text
    assert feed_all(HermesToolParser(), list(text)).content == text


def test_only_calls_leave_no_content_and_text_after_calls_is_dropped():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone.'
    extracted = HermesToolParser().extract(text)
    assert extracted.calls == [FunctionCallText("f", "{}")]
    assert extracted.content is None


def test_an_unclosed_block_runs_to_the_end():
    extracted = HermesToolParser().extract('<tool_call>{"name": "f", "arguments": {"a": [1, 2]}}')
    assert extracted.calls == [FunctionCallText("f", '{"a": [1, 2]}')]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # a brace short
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f"}</tool_call>',  # no arguments
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": 3}</tool_call>',
    ],
)
def test_an_unreadable_call_makes_the_whole_output_content(text):
    extracted = HermesToolParser().extract(text)
    assert extracted.calls == []
    assert extracted.content == text


def test_streamed_in_pieces_of_any_size_equals_whole():
    for cut in every_cut(TWO_CALLS):
        parsed = feed_all(HermesToolParser(), cut)
        assert parsed.content == "Let me look that up.\n", len(cut[0])
        assert join_call_deltas(parsed.calls) == EXPECTED_CALLS, len(cut[0])
        # A call's first delta names it, with no arguments; later ones only add arguments.
        for index in (0, 1):
            deltas = [delta for delta in parsed.calls if delta.index == index]
            assert deltas[0].name is not None and deltas[0].arguments == ""
            assert all(delta.name is None and delta.arguments for delta in deltas[1:])


def test_streamed_by_tokens_sends_arguments_as_they_come(tiny_tokenizer):
    chunks = token_pieces(tiny_tokenizer, TWO_CALLS)
    assert len(chunks) > 20
    parser = HermesToolParser()
    first_call = []
    for chunk in chunks:
        first_call.extend(delta for delta in parser.feed(chunk).calls if delta.index == 0)
    assert join_call_deltas(first_call) == EXPECTED_CALLS[:1]
    assert len(first_call) > 3  # the arguments came in several pieces, not at the end


def test_a_tag_split_across_deltas_is_held_back_not_sent_as_content():
    parser = HermesToolParser()
    assert parser.feed("Sure <tool").content == "Sure "
    assert parser.feed("_ca").content == ""
    parsed = parser.feed('ll>{"name": "f", "arguments": {"x": 1}}</tool_')
    assert parsed.content == ""
    assert [delta.name for delta in parsed.calls][:1] == ["f"]
    parsed.extend(parser.feed("call>"))
    parsed.extend(parser.finish())
    assert parsed.content == ""
    assert join_call_deltas(parsed.calls) == [FunctionCallText("f", '{"x": 1}')]
