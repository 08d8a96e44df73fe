"""Reasoning parsers: a model's output → `reasoning_content` and `content`, by
`--reasoning-parser` name.

Adding a parser: one module with a `ReasoningParser` subclass (see `abstract.py`), and its
name in REASONING_PARSERS.
"""

from __future__ import annotations

from tokenserve.entrypoints.openai.reasoning_parsers.abstract import ReasoningParser
from tokenserve.entrypoints.openai.reasoning_parsers.deepseek_r1 import (
    DeepSeekR1ReasoningParser,
)

# vLLM's names. Qwen3 marks its thinking the same way; its `enable_thinking=False`
# template closes the reasoning in the prompt, which every parser here detects.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": DeepSeekR1ReasoningParser,
}

__all__ = ["REASONING_PARSERS", "DeepSeekR1ReasoningParser", "ReasoningParser"]
