"""`--tool-call-parser hermes`: Hermes 2 Pro / Qwen 2.5 / Qwen 3 style tool calls,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. The content is the text before the first block; text between or after
blocks is dropped (vLLM reads it so). A block missing its end tag runs to the end of the
output. A block that is not a call object is content.
"""

from __future__ import annotations

from tokenserve.entrypoints.openai.text_markers import split_held_back
from tokenserve.entrypoints.openai.tool_parsers.abstract import ParsedDelta, ToolParser
from tokenserve.entrypoints.openai.tool_parsers.json_calls import JsonCallStream

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesToolParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._pending = ""  # text not passed on yet: a possible tag start, or a block's body
        self._call: JsonCallStream | None = None  # inside a block
        self._num_calls = 0  # calls whose name went out
        self._past_content = False  # a call was made: outside text is no longer content

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        parsed = ParsedDelta()
        while True:
            if self._call is None:
                start = self._pending.find(TOOL_CALL_START)
                if start < 0:
                    ready, self._pending = split_held_back(self._pending, TOOL_CALL_START)
                    self._outside(parsed, ready)
                    return parsed
                self._outside(parsed, self._pending[:start])
                self._pending = self._pending[start + len(TOOL_CALL_START) :]
                self._call = JsonCallStream(self._num_calls)
                continue
            end = self._pending.find(TOOL_CALL_END)
            if end < 0:
                body, _ = split_held_back(self._pending, TOOL_CALL_END)
                parsed.calls.extend(self._call.update(body))
                return parsed
            body = self._pending[:end]
            self._pending = self._pending[end + len(TOOL_CALL_END) :]
            parsed.calls.extend(self._call.update(body))
            self._close_call(parsed, body, closed=True)

    def finish(self) -> ParsedDelta:
        parsed = ParsedDelta()
        if self._call is None:
            self._outside(parsed, self._pending)
        else:
            parsed.calls.extend(self._call.update(self._pending))
            self._close_call(parsed, self._pending, closed=False)
        self._pending = ""
        return parsed

    def _outside(self, parsed: ParsedDelta, text: str) -> None:
        if not self._past_content:
            parsed.content += text

    def _close_call(self, parsed: ParsedDelta, body: str, closed: bool) -> None:
        call, self._call = self._call, None
        assert call is not None
        if not call.is_complete_call:
            self.invalid = True
            if not call.name_sent:
                # Nothing of it went out as a call: it is text, as a whole output shows it.
                self._outside(parsed, TOOL_CALL_START + body + (TOOL_CALL_END if closed else ""))
                return
        self._num_calls += 1
        self._past_content = True
