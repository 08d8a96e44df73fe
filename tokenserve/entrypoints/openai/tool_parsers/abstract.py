"""What every tool-call parser is: content in, content and tool calls out, whole or by delta.

A parser reads the assistant's content (what follows the reasoning, if any) and finds the
tool calls in it. One instance serves one choice: streaming keeps state between deltas.
A parser implements only the streaming side (`feed`, `finish`); reading a whole output is
feeding it at once, so a stream's deltas always join to the non-streamed message.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class ToolCallDelta:
    """A piece of the call at `index`: its first piece names the function (arguments "")."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    """What one delta of content turned into: plain content and pieces of tool calls."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


@dataclass
class FunctionCallText:
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass
class ExtractedToolCalls:
    content: str | None
    calls: list[FunctionCallText]


class ToolParser(ABC):
    def __init__(self) -> None:
        # Set when a call could not be read; a whole output with one is all content.
        self.invalid = False

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """The next piece of content; returns what can be told about it so far."""

    def finish(self) -> ParsedDelta:
        """The content has ended: whatever was held back."""
        return ParsedDelta()

    def extract(self, text: str) -> ExtractedToolCalls:
        """A whole output's calls and content. Calls whose arguments are not JSON, or any call
        that could not be read, make the whole text content (as vLLM does)."""
        parsed = self.feed(text)
        parsed.extend(self.finish())
        calls = join_call_deltas(parsed.calls)
        if self.invalid or not all(_is_json(call.arguments) for call in calls):
            return ExtractedToolCalls(content=text, calls=[])
        if not calls:
            return ExtractedToolCalls(content=parsed.content, calls=[])
        return ExtractedToolCalls(content=parsed.content or None, calls=calls)


def join_call_deltas(deltas: list[ToolCallDelta]) -> list[FunctionCallText]:
    """Pieces of calls, in order, joined into whole calls."""
    calls: dict[int, FunctionCallText] = {}
    for delta in deltas:
        if delta.name is not None:
            calls[delta.index] = FunctionCallText(delta.name, delta.arguments)
        else:
            calls[delta.index].arguments += delta.arguments
    return [calls[index] for index in sorted(calls)]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
