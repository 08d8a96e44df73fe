"""Admission that looks ahead at KV growth, so that a full cache preempts less.

Admitting a request when its prompt fits the free blocks is not enough under KV pressure:
every running request grows by a token each step, and requests admitted together grow
together, so the pool runs out a few steps later and the newest are preempted, their work
thrown away and recomputed. Each request's growth is bounded (its max_tokens, the model
length) and it gives all its blocks back when it finishes, so the scheduler can project
the blocks the running requests will hold over the next `lookahead` steps and admit a
request only if the peak of that projection, with it, fits the pool. Steps with free
blocks to spare take a quick upper bound and never the full projection.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenserve.core.request import Request


def remaining_tokens(request: Request, max_model_len: int) -> int:
    """How many more tokens the request may generate."""
    limit = max_model_len - request.num_tokens
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None:
        limit = min(limit, max_tokens - request.num_output_tokens)
    return max(limit, 0)


def peak_blocks(
    num_tokens: Sequence[int], remaining: Sequence[int], block_size: int, lookahead: int
) -> int:
    """The most blocks held at once over the next `lookahead` steps by requests now
    `num_tokens` long, each growing a token a step and letting go of every block once it
    has generated its `remaining` tokens."""
    if not num_tokens:
        return 0
    length = np.asarray(num_tokens, dtype=np.int64)
    left = np.minimum(np.asarray(remaining, dtype=np.int64), lookahead)
    # The projection only drops when a request finishes, so its peak is just before a
    # finish or at the end of the window.
    steps = np.unique(np.append(np.maximum(left - 1, 0), lookahead))
    alive = (left[:, None] > steps[None, :]) | (left[:, None] == lookahead)
    held = -(-(length[:, None] + np.minimum(steps[None, :], left[:, None])) // block_size)
    return int((held * alive).sum(axis=0).max())


def admission_fits(
    request: Request,
    running: Sequence[Request],
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    lookahead: int,
) -> bool:
    """Whether admitting `request` keeps the projected peak of the running requests and it
    within `num_blocks`. A request that would run alone is always admitted."""
    if lookahead <= 0 or not running:
        return True
    requests = [*running, request]
    lengths = [r.num_tokens for r in requests]
    remaining = [remaining_tokens(r, max_model_len) for r in requests]
    # Everyone at the end of the window, nobody finished: an upper bound on the peak.
    bound = sum(-(-(n + min(m, lookahead)) // block_size) for n, m in zip(lengths, remaining))
    if bound <= num_blocks:
        return True
    return peak_blocks(lengths, remaining, block_size, lookahead) <= num_blocks
