"""tool_choice "required" and named: the schemas that force calls, and their reading."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.entrypoints.openai.parser_streams import every_cut, feed_all
from tokenserve.entrypoints.openai.tool_parsers import FunctionCallText
from tokenserve.entrypoints.openai.tool_parsers.abstract import join_call_deltas
from tokenserve.entrypoints.openai.tool_parsers.forced import (
    NamedToolCallParser,
    RequiredToolCallsParser,
    required_calls_schema,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
FUNCTIONS = [("get_weather", WEATHER), ("get_time", None)]


@pytest.mark.parametrize(
    ("calls", "valid"),
    [
        ([{"name": "get_weather", "parameters": {"city": "Paris"}}], True),
        ([{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}], True),
        ([], False),  # at least one call
        ([{"name": "get_weather", "parameters": {"unit": "celsius"}}], False),  # city missing
        ([{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}], False),
        ([{"name": "get_time", "parameters": {"timezone": "UTC"}}], False),  # takes none
        ([{"name": "get_news", "parameters": {}}], False),  # not a tool
        ([{"name": "get_time"}], False),
    ],
)  # fmt: skip
def test_required_schema_accepts_only_calls_of_the_tools(calls, valid):
    schema = required_calls_schema(FUNCTIONS)
    if valid:
        jsonschema.validate(calls, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(calls, schema)


def test_no_parallel_calls_allows_one():
    schema = required_calls_schema(FUNCTIONS, parallel_tool_calls=False)
    one = [{"name": "get_time", "parameters": {}}]
    jsonschema.validate(one, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(one * 2, schema)


REQUIRED_OUTPUT = (
    '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
    '{"name": "get_time", "parameters": {}}]'
)


def test_required_output_is_read_whole_and_streamed_alike():
    expected = [
        FunctionCallText("get_weather", '{"city": "Paris", "unit": "celsius"}'),
        FunctionCallText("get_time", "{}"),
    ]
    extracted = RequiredToolCallsParser().extract(REQUIRED_OUTPUT)
    assert extracted.calls == expected and extracted.content is None
    for cut in every_cut(REQUIRED_OUTPUT):
        parsed = feed_all(RequiredToolCallsParser(), cut)
        assert join_call_deltas(parsed.calls) == expected, len(cut[0])
        assert parsed.content == ""


@pytest.mark.parametrize("end", range(len(REQUIRED_OUTPUT)))
def test_required_output_cut_off_is_the_calls_read_so_far_never_content(end):
    """Issue 25: a cut "required" output leaked its raw JSON as content when whole, and
    gave the calls read so far when streamed; now both give the streamed calls."""
    text = REQUIRED_OUTPUT[:end]
    extracted = RequiredToolCallsParser().extract(text)
    assert extracted.content is None
    for cut in every_cut(text) if text else [[]]:
        assert join_call_deltas(feed_all(RequiredToolCallsParser(), cut).calls) == extracted.calls
    if end <= len('[{"name": "get_weather", "parameters": '):
        assert extracted.calls == []  # no name read yet
    else:
        [first, *_] = extracted.calls
        assert first.name == "get_weather" and REQUIRED_OUTPUT.find(first.arguments) > 0


@pytest.mark.parametrize("end", range(1, 18))
def test_named_output_cut_off_is_still_the_call(end):
    """Issue 25: a cut named call was content when whole and a call when streamed."""
    text = '{"city": "Paris"}'[:end]
    extracted = NamedToolCallParser("get_weather").extract(text)
    assert extracted.content is None
    assert extracted.calls == [FunctionCallText("get_weather", text)]
    for cut in every_cut(text):
        assert join_call_deltas(feed_all(NamedToolCallParser("get_weather"), cut).calls) == [
            FunctionCallText("get_weather", text)
        ]


def test_named_output_is_the_arguments():
    arguments = '{"city": "Paris"}'
    extracted = NamedToolCallParser("get_weather").extract(arguments)
    assert extracted.calls == [FunctionCallText("get_weather", arguments)]
    assert json.loads(extracted.calls[0].arguments) == {"city": "Paris"}
    parsed = feed_all(NamedToolCallParser("get_weather"), ["{", '"city": ', '"Paris"}'])
    assert parsed.calls[0].name == "get_weather" and parsed.calls[0].arguments == ""
    assert [delta.arguments for delta in parsed.calls[1:]] == ["{", '"city": ', '"Paris"}']


def test_a_raw_control_character_in_a_string_does_not_swallow_the_rest():
    # A grammar may let one through; the call must still end at its own closing brace.
    text = '[{"name": "get_weather", "parameters": {"city": "a\x18b"}}]'
    extracted = RequiredToolCallsParser().extract(text)
    assert extracted.calls == [FunctionCallText("get_weather", '{"city": "a\x18b"}')]
