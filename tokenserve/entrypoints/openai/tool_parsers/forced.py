"""`tool_choice="required"` and a named tool: calls forced by a JSON schema, and their reading.

- required: the output is a JSON array of at least one `{"name": ..., "parameters": ...}`,
  each item one of the tools (`anyOf`, the name as a one-value enum), so every call names
  a tool and its arguments validate against that tool's schema. `parallel_tool_calls=false`
  allows one item only.
- named: the output is the named function's arguments, valid against its schema.

These need no tool-call parser flag: the format is the server's own. Being forced, the
output is never content: a whole output reads as its stream joins, so an output cut by
max_tokens still answers with the calls read so far (named: its one call, with the arguments
as generated; required: the calls whose names were read, none if none). Output that is all
reasoning (cut before the grammar began) has no call yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenserve.entrypoints.openai.tool_parsers.abstract import (
    ExtractedToolCalls,
    ParsedDelta,
    ToolCallDelta,
    ToolParser,
    join_call_deltas,
)
from tokenserve.entrypoints.openai.tool_parsers.json_calls import (
    JsonCallSequence,
    skip_whitespace,
)

# A function declared without parameters takes none: its arguments are `{}`.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters if parameters is not None else NO_PARAMETERS


def required_calls_schema(
    functions: Sequence[tuple[str, dict[str, Any] | None]], parallel_tool_calls: bool = True
) -> dict[str, Any]:
    """The schema of `tool_choice="required"` output, for (name, parameters) functions."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [name]},
                "parameters": parameters_schema(parameters),
            },
            "required": ["name", "parameters"],
        }
        for name, parameters in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


class ForcedToolParser(ToolParser):
    """A format the grammar forced: no content, and a whole output gives what its stream
    gives, even cut off (no fallback to content as for free text)."""

    def extract(self, text: str) -> ExtractedToolCalls:
        parsed = self.feed(text)
        parsed.extend(self.finish())
        return ExtractedToolCalls(content=None, calls=join_call_deltas(parsed.calls))


class RequiredToolCallsParser(ForcedToolParser):
    """Reads `[{"name": ..., "parameters": ...}, ...]`; nothing of it is content."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._array_start: int | None = None
        self._sequence = JsonCallSequence(separator=",", argument_keys=("parameters",))

    def feed(self, text: str) -> ParsedDelta:
        self._text += text
        if self._array_start is None:
            i = skip_whitespace(self._text, 0)
            if i == len(self._text):
                return ParsedDelta()
            if self._text[i] != "[":
                self.invalid = True
                self._sequence.close()
            self._array_start = i + 1
        return ParsedDelta(calls=self._sequence.update(self._text[self._array_start :]))

    def finish(self) -> ParsedDelta:
        self._sequence.close()
        self.invalid = self.invalid or self._sequence.invalid or not self._sequence.num_calls
        return ParsedDelta()


class NamedToolCallParser(ForcedToolParser):
    """The whole output is the arguments of the one function `name`."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._started = False

    def feed(self, text: str) -> ParsedDelta:
        parsed = self._start()
        if text:
            parsed.calls.append(ToolCallDelta(0, arguments=text))
        return parsed

    def finish(self) -> ParsedDelta:
        return self._start()

    def _start(self) -> ParsedDelta:
        if self._started:
            return ParsedDelta()
        self._started = True
        return ParsedDelta(calls=[ToolCallDelta(0, name=self.name)])
