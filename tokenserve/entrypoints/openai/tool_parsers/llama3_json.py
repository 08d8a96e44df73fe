"""`--tool-call-parser llama3_json`: Llama 3.x JSON tool calls,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

("arguments" is read as well), maybe after `<|python_tag|>`, several separated by `;`.
An output is calls when it begins (after whitespace) with `<|python_tag|>` or `{`, and
content otherwise. An output that begins with a JSON object that is not a call (no
name, no arguments) is content too; text after the calls is dropped.
"""

from __future__ import annotations

from tokenserve.entrypoints.openai.tool_parsers.abstract import ParsedDelta, ToolParser
from tokenserve.entrypoints.openai.tool_parsers.json_calls import JsonCallSequence

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._raw = ""  # all text so far, while it may still turn out to be content
        self._mode = "undecided"  # then "content" or "calls"
        self._calls_start = 0  # where the calls begin in _raw
        self._sequence = JsonCallSequence(separator=";")

    def feed(self, text: str) -> ParsedDelta:
        if self._mode == "content":
            return ParsedDelta(content=text)
        self._raw += text
        if self._mode == "undecided":
            stripped = self._raw.lstrip()
            if not stripped or PYTHON_TAG.startswith(stripped):
                return ParsedDelta()  # nothing to decide on yet
            offset = len(self._raw) - len(stripped)
            if stripped.startswith(PYTHON_TAG):
                self._calls_start = offset + len(PYTHON_TAG)
            elif stripped.startswith("{"):
                self._calls_start = offset
            else:
                return self._become_content()
            self._mode = "calls"
        parsed = ParsedDelta(calls=self._sequence.update(self._raw[self._calls_start :]))
        if self._sequence.invalid and not self._sequence.started_calls:
            return self._become_content()
        return parsed

    def finish(self) -> ParsedDelta:
        if self._mode == "undecided":
            return self._become_content()
        if self._mode == "calls":
            self._sequence.close()
            if not self._sequence.started_calls:
                return self._become_content()
            self.invalid = self._sequence.invalid
        return ParsedDelta()

    def _become_content(self) -> ParsedDelta:
        """Not calls after all: everything held so far goes out as content."""
        self._mode = "content"
        self.invalid = False
        text, self._raw = self._raw, ""
        return ParsedDelta(content=text)
