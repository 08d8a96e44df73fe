"""What every reasoning parser is: a model's output → its reasoning and its content.

A parser reads the output, whole or delta by delta (one instance per choice: streaming
keeps state), and says which text is reasoning and which is the answer. It runs in the
API process; the engine only needs `end_marker`, as token ids, to start a structured
output's grammar after the reasoning (`StructuredOutputsParams.enforce_after_token_ids`).
A whole output is read by feeding it at once, so a stream's deltas always join to the
non-streamed message.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class ReasoningParser(ABC):
    # The text that ends the reasoning.
    end_marker: str

    def __init__(self, reasoning_ended: bool = False) -> None:
        """`reasoning_ended`: the prompt closed the reasoning; the output is all content."""
        self.reasoning_ended = reasoning_ended

    @abstractmethod
    def feed(self, text: str) -> tuple[str, str]:
        """The next piece of output → (reasoning, content) that can go out now."""

    def finish(self) -> tuple[str, str]:
        """The output has ended: whatever was held back."""
        return "", ""

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """A whole output → (reasoning, content), None for an empty part."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None

    @classmethod
    def prompt_ends_reasoning(cls, prompt: str) -> bool:
        """True when the prompt itself closes the reasoning (a template that turns thinking
        off ends the prompt with an empty `<think>\\n\\n</think>\\n\\n`)."""
        return prompt.rstrip().endswith(cls.end_marker)
