"""Tool-call parsers: the assistant's content → tool calls, by `--tool-call-parser` name.

Adding a parser: one module with a `ToolParser` subclass (see `abstract.py`), and its
name in TOOL_PARSERS.
"""

from __future__ import annotations

from tokenserve.entrypoints.openai.tool_parsers.abstract import (
    ExtractedToolCalls,
    FunctionCallText,
    ParsedDelta,
    ToolCallDelta,
    ToolParser,
)
from tokenserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from tokenserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

# vLLM's names.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}

__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "FunctionCallText",
    "ParsedDelta",
    "ToolCallDelta",
    "ToolParser",
]
