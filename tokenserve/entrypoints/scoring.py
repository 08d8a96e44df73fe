"""Scoring text pairs, shared by `LLM.score` and the server's /score and /rerank: the pairs
(one text against many, or pairwise), a cross-encoder's prompt for a pair (the tokenizer's
pair encoding and its token types), and the cosine similarity an embedding model scores by."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against every text_2, or text_1[i] with text_2[i]."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("text_1 and text_2 must each hold at least one text.")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as "
            "many as text_2."
        )
    for text in (*first, *second):
        if not isinstance(text, str):
            raise ValueError(f"Texts to score must be strings, got {type(text).__name__}.")  # noqa: TRY004
    return list(zip(first, second))


def cross_encoder_prompt(
    tokenizer, text_1: str, text_2: str, truncate_prompt_tokens: int | None = None
) -> dict[str, Any]:
    """The pair as one prompt (`[CLS] a [SEP] b [SEP]` for BERT) with its token types."""
    kwargs: dict[str, Any] = {}
    if truncate_prompt_tokens is not None and truncate_prompt_tokens > 0:
        kwargs = {"truncation": True, "max_length": truncate_prompt_tokens}
    encoded = tokenizer(text_1, text_2, **kwargs)
    prompt: dict[str, Any] = {"prompt_token_ids": list(encoded["input_ids"])}
    if encoded.get("token_type_ids") is not None:
        prompt["token_type_ids"] = list(encoded["token_type_ids"])
    return prompt


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm > 0 else 0.0
