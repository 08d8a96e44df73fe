"""Pooling requests at the edge: their params checked against the model (task, matryoshka
`dimensions`), their prompts truncated and their token types compressed, as vLLM does.
Everything wrong is a ValueError here; nothing invalid reaches the engine core."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tokenserve.config import ModelConfig
from tokenserve.pooling_params import PoolingParams


def check_pooling_params(params: PoolingParams, model_config: ModelConfig) -> PoolingParams:
    """`params` with its task resolved, or a ValueError saying what this model cannot do."""
    if model_config.runner != "pooling":
        raise ValueError(
            "This model runs the 'generate' runner: embeddings, scores and classes need a "
            "pooling model (start it with runner='pooling' / --runner pooling)."
        )
    tasks = model_config.pooling_tasks
    task = params.task or tasks[0]
    if task not in tasks:
        raise ValueError(
            f"This model does not support the {task!r} task; it supports {', '.join(tasks)}."
        )
    if params.dimensions is not None:
        if task != "embed":
            raise ValueError("dimensions applies to embeddings only.")
        if not model_config.is_matryoshka:
            raise ValueError(
                f"Model {model_config.model!r} does not support matryoshka representation, "
                "changing output dimensions will lead to poor results."
            )
        hidden_size = model_config.hf_config.hidden_size
        if params.dimensions > hidden_size:
            raise ValueError(
                f"dimensions must be at most the model's hidden size {hidden_size}, "
                f"got {params.dimensions}."
            )
    return dataclasses.replace(params, task=task)


def truncate_length(params: PoolingParams, max_model_len: int) -> int | None:
    """How many prompt tokens to keep, or None: all of them."""
    if params.truncate_prompt_tokens is None:
        return None
    if params.truncate_prompt_tokens == -1:
        return max_model_len
    if params.truncate_prompt_tokens > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens ({params.truncate_prompt_tokens}) must be at most "
            f"max_model_len ({max_model_len})."
        )
    return params.truncate_prompt_tokens


def token_type_start(token_type_ids: Sequence[int], num_tokens: int) -> int | None:
    """The first position of token type 1 in a text pair's token types (all 0, then all 1)."""
    types = list(token_type_ids)
    if len(types) != num_tokens:
        raise ValueError(
            f"token_type_ids has {len(types)} entries for a prompt of {num_tokens} tokens."
        )
    if any(t not in (0, 1) for t in types):
        raise ValueError("token_type_ids must hold 0s and 1s only.")
    start = types.index(1) if 1 in types else None
    if start is not None and any(t != 1 for t in types[start:]):
        raise ValueError("token_type_ids must be 0s followed by 1s (one text pair).")
    return start
