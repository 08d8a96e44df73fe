"""Marker strings (`</think>`, `<tool_call>`) in text that arrives in pieces.

A stream cannot pass on the end of a delta that might be the beginning of a marker: the
next delta decides. The reasoning and tool-call parsers hold such an end back.
"""

from __future__ import annotations


def held_back_length(text: str, *markers: str) -> int:
    """How many characters at the end of `text` could begin one of `markers` (and so wait)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def split_held_back(text: str, *markers: str) -> tuple[str, str]:
    """`text` as (what may go out now, what waits for the next delta)."""
    keep = held_back_length(text, *markers)
    return text[: len(text) - keep], text[len(text) - keep :]
