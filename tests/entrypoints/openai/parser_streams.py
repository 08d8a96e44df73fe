"""Feeding parsers the way a stream does: text cut into pieces (fixed sizes, or tokens)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from tokenserve.entrypoints.openai.tool_parsers import ParsedDelta, ToolParser


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def every_cut(text: str) -> Iterator[list[str]]:
    """The text in pieces of every size from 1 character to all of it."""
    for size in range(1, len(text) + 1):
        yield pieces(text, size)


def token_pieces(tokenizer: Any, text: str) -> list[str]:
    """The text as a detokenizer streams it: one piece per token."""
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    texts = [tokenizer.decode(token_ids[:n]) for n in range(len(token_ids) + 1)]
    return [after[len(before) :] for before, after in itertools.pairwise(texts)]


def feed_all(parser: ToolParser, chunks: list[str]) -> ParsedDelta:
    """Every delta the parser gave, in order, joined (the finish included)."""
    parsed = ParsedDelta()
    for chunk in chunks:
        parsed.extend(parser.feed(chunk))
    parsed.extend(parser.finish())
    return parsed
