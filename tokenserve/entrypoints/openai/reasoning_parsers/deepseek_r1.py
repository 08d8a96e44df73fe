"""`--reasoning-parser deepseek_r1` (and `qwen3`): reasoning between `<think>` and `</think>`.

As vLLM's deepseek_r1 parser reads it: the `<think>` may be missing (the chat template
often puts it in the prompt), so everything before `</think>` is reasoning and everything
after it is content; an output without `</think>` is all reasoning (cut off while
thinking). A `<think>` before the `</think>` is dropped. When the prompt already closed
the reasoning, the output is all content.

The markers are found in the text, so they may span several tokens and several deltas: a
delta ending with what could begin a marker holds that end back until the next one.
"""

from __future__ import annotations

from tokenserve.entrypoints.openai.reasoning_parsers.abstract import ReasoningParser
from tokenserve.entrypoints.openai.text_markers import split_held_back

THINK_START = "<think>"
THINK_END = "</think>"


class DeepSeekR1ReasoningParser(ReasoningParser):
    end_marker = THINK_END

    def __init__(self, reasoning_ended: bool = False) -> None:
        super().__init__(reasoning_ended)
        self._pending = ""  # reasoning text held back: it may begin a marker
        self._start_dropped = False

    def feed(self, text: str) -> tuple[str, str]:
        if self.reasoning_ended:
            return "", text
        self._pending += text
        if not self._start_dropped:
            start = self._pending.find(THINK_START)
            end = self._pending.find(THINK_END)
            if start >= 0 and (end < 0 or start < end):
                self._pending = self._pending[:start] + self._pending[start + len(THINK_START) :]
                self._start_dropped = True
        end = self._pending.find(THINK_END)
        if end >= 0:
            reasoning, content = self._pending[:end], self._pending[end + len(THINK_END) :]
            self._pending = ""
            self.reasoning_ended = True
            return reasoning, content
        markers = (THINK_END,) if self._start_dropped else (THINK_END, THINK_START)
        reasoning, self._pending = split_held_back(self._pending, *markers)
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        reasoning, self._pending = self._pending, ""
        return reasoning, ""
