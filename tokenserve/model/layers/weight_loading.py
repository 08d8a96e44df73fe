"""Putting checkpoint tensors into parameters: what every layer's weight loader ends in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

# Where a shard goes in a parameter's rows: (first row, number of rows); None: all of them.
Rows = tuple[int, int] | None

# Where copy_rows hands its copies inside `copies_submitted_to` (None: it copies at once).
# A context, as torch.no_grad is, because the weight loaders that end in copy_rows are many
# and nested, and their (param, weight, shard_id) signature is the models' contract.
_submit_copy: ContextVar[Callable[..., None] | None] = ContextVar("submit_copy", default=None)


@contextmanager
def copies_submitted_to(submit: Callable[..., None]) -> Iterator[None]:
    """Within the block copy_rows checks each weight's shape at once and passes its copy to
    `submit(copy, source)` (a load's worker threads, model/load_threads.py); the caller
    waits for them before reading the parameters."""
    token = _submit_copy.set(submit)
    try:
        yield
    finally:
        _submit_copy.reset(token)


def copy_rows(param: torch.Tensor, loaded_weight, rows: Rows = None) -> None:
    """Copy a checkpoint tensor into param (its dtype converted), or into its `rows`.
    Another form of a weight (GGUF blocks) is not a tensor: it is left to the quantization
    methods that keep it, and ignored here (the weight's dense form is always loaded too)."""
    if not isinstance(loaded_weight, torch.Tensor):
        return
    destination = param.data if rows is None else param.data.narrow(0, *rows)
    if destination.shape != loaded_weight.shape:
        raise ValueError(
            f"shape {tuple(loaded_weight.shape)} does not fit the parameter's "
            f"{tuple(destination.shape)} (from the model config)"
        )
    submit = _submit_copy.get()
    if submit is None:
        destination.copy_(loaded_weight)
    else:
        submit(destination.copy_, loaded_weight)


def default_weight_loader(param: torch.Tensor, loaded_weight, shard_id=None) -> None:
    """The loader of a parameter that is the same on every rank (a norm's weight)."""
    copy_rows(param, loaded_weight)
