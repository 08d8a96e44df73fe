"""Tool calls written as JSON objects, `{"name": "f", "arguments": {...}}`, read as they grow.

The object is scanned key by key with the standard JSON decoder. The arguments are kept
as the exact text the model wrote (not re-serialized), so that the pieces streamed while
they arrive join to the same string a whole output gives. While the arguments value is
still open, all text after its start belongs to it: that prefix can go out at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenserve.entrypoints.openai.tool_parsers.abstract import ToolCallDelta

ARGUMENT_KEYS = ("arguments", "parameters")
# Raw control characters in strings are read, not refused: a grammar may let them through,
# and a call must still end where its object ends.
_DECODER = json.JSONDecoder(strict=False)
_WHITESPACE = " \t\n\r"


def skip_whitespace(text: str, index: int) -> int:
    while index < len(text) and text[index] in _WHITESPACE:
        index += 1
    return index


@dataclass
class ScannedCall:
    name: str | None = None
    arguments: str | None = None  # the arguments' text so far; None before its value starts
    arguments_complete: bool = False
    end: int | None = None  # just past the closing brace, once the object is complete
    invalid: bool = False  # not a call object, whatever follows


def scan_call(text: str, argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> ScannedCall:
    """What the (possibly unfinished) call object at the start of `text` tells so far."""
    scanned = ScannedCall()
    i = skip_whitespace(text, 0)
    if i == len(text):
        return scanned
    if text[i] != "{":
        return ScannedCall(invalid=True)
    i = skip_whitespace(text, i + 1)
    if text.startswith("}", i):
        scanned.end = i + 1
        return scanned
    while True:
        if i == len(text):
            return scanned
        if text[i] != '"':
            return ScannedCall(invalid=True)
        try:
            key, i = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            return scanned  # the key is still arriving
        i = skip_whitespace(text, i)
        if i == len(text):
            return scanned
        if text[i] != ":":
            return ScannedCall(invalid=True)
        start = i = skip_whitespace(text, i + 1)
        if i == len(text):
            return scanned
        is_arguments = key in argument_keys
        if is_arguments and scanned.arguments is not None:
            return ScannedCall(invalid=True)  # "arguments" and "parameters" both
        try:
            value, i = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            # Still arriving (or broken: the object then never completes).
            if is_arguments:
                scanned.arguments = text[start:]
            return scanned
        if i == len(text) and isinstance(value, (int, float)):
            # A number at the very end may have more digits coming.
            if is_arguments:
                scanned.arguments = text[start:]
            return scanned
        if key == "name":
            if not isinstance(value, str):
                return ScannedCall(invalid=True)
            scanned.name = value
        elif is_arguments:
            scanned.arguments = text[start:i]
            scanned.arguments_complete = True
        i = skip_whitespace(text, i)
        if i == len(text):
            return scanned
        if text[i] == "}":
            scanned.end = i + 1
            return scanned
        if text[i] != ",":
            return ScannedCall(invalid=True)
        i = skip_whitespace(text, i + 1)


class JsonCallStream:
    """One call object arriving in pieces: its name as soon as it is known (and its
    arguments have begun), then its arguments' text as it comes."""

    def __init__(self, index: int, argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> None:
        self.index = index
        self.argument_keys = argument_keys
        self.name_sent = False
        self._arguments_sent = 0
        self.scanned = ScannedCall()

    def update(self, text: str) -> list[ToolCallDelta]:
        """`text`: the object's whole text so far. Returns the new pieces."""
        self.scanned = scanned = scan_call(text, self.argument_keys)
        deltas: list[ToolCallDelta] = []
        if scanned.invalid:
            return deltas
        if not self.name_sent and scanned.name is not None and scanned.arguments is not None:
            self.name_sent = True
            deltas.append(ToolCallDelta(self.index, name=scanned.name))
        if self.name_sent and scanned.arguments and len(scanned.arguments) > self._arguments_sent:
            deltas.append(
                ToolCallDelta(self.index, arguments=scanned.arguments[self._arguments_sent :])
            )
            self._arguments_sent = len(scanned.arguments)
        return deltas

    @property
    def is_complete_call(self) -> bool:
        return self.scanned.end is not None and self.name_sent and self.scanned.arguments_complete


class JsonCallSequence:
    """Call objects one after another with `separator` between them (`{...}; {...}`, or the
    inside of `[{...}, {...}]`), read as the text grows.

    Reading ends at anything else (a `]`, trailing text); it is `invalid` when a call object
    is broken.
    """

    def __init__(self, separator: str, argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> None:
        self.separator = separator
        self.argument_keys = argument_keys
        self.num_calls = 0  # calls read whole
        self.invalid = False
        self.ended = False
        self._position = 0  # where the next call (or separator) may start
        self._call: JsonCallStream | None = None
        self._call_start = 0

    @property
    def started_calls(self) -> int:
        """Calls whose name has gone out."""
        return self.num_calls + int(self._call is not None and self._call.name_sent)

    def update(self, text: str) -> list[ToolCallDelta]:
        """`text`: the whole sequence so far. Returns the new pieces."""
        deltas: list[ToolCallDelta] = []
        while not self.ended:
            if self._call is None:
                i = skip_whitespace(text, self._position)
                if self.num_calls and text.startswith(self.separator, i):
                    i = skip_whitespace(text, i + len(self.separator))
                if i == len(text):
                    break
                if text[i] != "{":
                    self.ended = True
                    break
                self._call = JsonCallStream(self.num_calls, self.argument_keys)
                self._call_start = i
            deltas.extend(self._call.update(text[self._call_start :]))
            scanned = self._call.scanned
            if scanned.end is None and not scanned.invalid:
                break
            if not self._call.is_complete_call:
                self.invalid = self.ended = True
                break
            assert scanned.end is not None
            self.num_calls += 1
            self._position = self._call_start + scanned.end
            self._call = None
        return deltas

    def close(self) -> None:
        """No more text: an unfinished call is a broken one."""
        if self._call is not None:
            self.invalid = True
        self.ended = True
