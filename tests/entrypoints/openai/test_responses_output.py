"""The assistant message as Responses output items: the stream's events add up to the
items a whole output gives, in OpenAI's order, with sequence numbers 0, 1, 2, ..."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.parser_streams import every_cut
from tokenserve.entrypoints.openai.assistant_message import AssistantMessageParser
from tokenserve.entrypoints.openai.reasoning_parsers import DeepSeekR1ReasoningParser
from tokenserve.entrypoints.openai.responses_output import ResponseEvents, output_items
from tokenserve.entrypoints.openai.serving_responses import count_tokens_through
from tokenserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser

OUTPUT = (
    "<think>Weather, so a tool.</think>Checking.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def new_parser() -> AssistantMessageParser:
    return AssistantMessageParser(DeepSeekR1ReasoningParser(), HermesToolParser())


def stream(chunks: list[str], incomplete: bool) -> tuple[list[dict], ResponseEvents]:
    parser, events = new_parser(), ResponseEvents()
    texts: list[str] = []
    for chunk in chunks:
        for delta in parser.feed(chunk):
            texts += events.feed(delta)
    for delta in parser.finish():
        texts += events.feed(delta)
    texts += events.finish(incomplete)
    parsed = []
    for text in texts:
        name_line, data_line, *_ = text.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {event['type']}"
        parsed.append(event)
    return parsed, events


def items_without_ids(items) -> list[dict]:
    return [item.model_dump(exclude={"id", "call_id"}) for item in items]


@pytest.mark.parametrize("incomplete", [False, True])
def test_streamed_items_equal_the_whole_outputs(incomplete):
    whole = output_items(new_parser().parse(OUTPUT), incomplete)
    assert [item.type for item in whole] == ["reasoning", "message", "function_call"]
    assert [item.status for item in whole][-1] == ("incomplete" if incomplete else "completed")
    for chunks in every_cut(OUTPUT):
        events, stream_state = stream(chunks, incomplete)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert items_without_ids(stream_state.items) == items_without_ids(whole), len(chunks[0])
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert done == [item.model_dump() for item in stream_state.items]


def test_event_order_per_item():
    events, _ = stream([OUTPUT], incomplete=False)
    kinds = [e["type"].removeprefix("response.") for e in events]
    assert kinds == [
        "output_item.added", "content_part.added", "reasoning_text.delta",
        "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done",
    ]  # fmt: skip
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1, 2]
    assert all(e["item"]["status"] == "in_progress" for e in added)
    [arguments_done] = [e for e in events if e["type"].endswith("arguments.done")]
    assert arguments_done["name"] == "get_weather"
    assert json.loads(arguments_done["arguments"]) == {"city": "Paris"}


def test_reasoning_tokens_are_those_through_the_end_marker(tiny_tokenizer):
    reasoning = tiny_tokenizer.encode("<think>The sky is blue.</think>", add_special_tokens=False)
    answer = tiny_tokenizer.encode(" Because of the air.", add_special_tokens=False)
    token_ids = reasoning + answer
    assert count_tokens_through(tiny_tokenizer, token_ids, "</think>") == len(reasoning)
    assert count_tokens_through(tiny_tokenizer, reasoning[:-2], "</think>") == len(reasoning) - 2
