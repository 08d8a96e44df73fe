"""The llama3_json tool-call parser: whole outputs, and the same outputs streamed in pieces."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.parser_streams import every_cut, feed_all, token_pieces
from tokenserve.entrypoints.openai.tool_parsers import FunctionCallText
from tokenserve.entrypoints.openai.tool_parsers.abstract import join_call_deltas
from tokenserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

CALLS = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
    '{"name": "get_time", "arguments": {"timezone": "UTC"}}'
)
EXPECTED_CALLS = [
    FunctionCallText("get_weather", '{"city": "Paris", "unit": "celsius"}'),
    FunctionCallText("get_time", '{"timezone": "UTC"}'),
]


@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", "\n  "])
def test_one_call_with_parameters_or_arguments(prefix):
    text = prefix + '{"name": "search", "parameters": {"query": "tokenserve", "limit": 5}}'
    extracted = Llama3JsonToolParser().extract(text)
    assert extracted.calls == [FunctionCallText("search", '{"query": "tokenserve", "limit": 5}')]
    assert extracted.content is None


def test_several_calls_separated_by_semicolons():
    extracted = Llama3JsonToolParser().extract(CALLS)
    assert extracted.calls == EXPECTED_CALLS
    assert extracted.content is None


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is sunny.",
        'I would call {"name": "f", "parameters": {}} but will not.',  # not at the start
        '{"answer": 42, "unit": "km"}',  # JSON, not a call
        '{"name": "Paris", "population": 2100000}',  # a name, no arguments
        "",
    ],
)
def test_anything_else_is_content(text):
    extracted = Llama3JsonToolParser().extract(text)
    assert extracted.calls == []
    assert extracted.content == text
    streamed = feed_all(Llama3JsonToolParser(), list(text))
    assert streamed.content == text and streamed.calls == []


def test_a_call_cut_off_is_content_whole_but_begun_in_a_stream():
    text = '{"name": "f", "parameters": {"a": 1}'  # max_tokens hit inside the call
    assert Llama3JsonToolParser().extract(text).content == text
    parser = Llama3JsonToolParser()
    streamed = feed_all(parser, list(text))
    # What went out cannot be taken back: the call began, though its object never closed.
    assert join_call_deltas(streamed.calls) == [FunctionCallText("f", '{"a": 1}')]
    assert parser.invalid


def test_streamed_in_pieces_of_any_size_equals_whole():
    for cut in every_cut(CALLS):
        parsed = feed_all(Llama3JsonToolParser(), cut)
        assert parsed.content == "", len(cut[0])
        assert join_call_deltas(parsed.calls) == EXPECTED_CALLS, len(cut[0])
        # A call's first delta names it, with no arguments; later ones only add arguments.
        for index in (0, 1):
            deltas = [delta for delta in parsed.calls if delta.index == index]
            assert deltas[0].name is not None and deltas[0].arguments == ""
            assert all(delta.name is None and delta.arguments for delta in deltas[1:])


def test_streamed_by_tokens(tiny_tokenizer):
    chunks = token_pieces(tiny_tokenizer, CALLS.removeprefix("<|python_tag|>"))
    parsed = feed_all(Llama3JsonToolParser(), chunks)
    assert join_call_deltas(parsed.calls) == EXPECTED_CALLS
    assert len(parsed.calls) > 6
