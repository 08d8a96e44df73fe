"""Pooling parameters of one request: what a pooling model returns for its prompt.

Names, meanings and defaults follow vLLM's `PoolingParams`. A pooling request computes its
prompt and finishes: no token is sampled. Like SamplingParams, a plain dataclass of
msgspec-encodable fields, shipped to the engine-core process as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

# The tasks a pooling model may serve (vLLM's names).
POOLING_TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    """`task`: "embed" (a vector), "classify" (class probabilities) or "score" (one relevance
    number of a text pair, from a cross-encoder); None: the model's first task.
    `dimensions`: keep the first n of an embedding (matryoshka models only).
    `normalize`: L2-normalize an embedding (None: the model's own setting).
    `use_activation`: softmax / sigmoid over classifier logits (False: the raw logits).
    `truncate_prompt_tokens`: keep the first k tokens of a text prompt (the last k of token
    ids), -1: max_model_len."""

    task: str | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    # Set by the Processor for a text pair (cross-encoders): the first position of the second
    # text, where token type 1 starts (vLLM's compressed_token_type_ids).
    token_type_start: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {list(POOLING_TASKS)}, got {self.task!r}.")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}.")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (
            isinstance(truncate, bool) or not isinstance(truncate, int) or truncate == 0
            or truncate < -1
        ):
            raise ValueError(
                f"truncate_prompt_tokens must be a positive integer or -1, got {truncate!r}."
            )
