"""Putting checkpoint tensors into parameters: what every layer's weight loader ends in."""

from __future__ import annotations

import torch

# Where a shard goes in a parameter's rows: (first row, number of rows); None: all of them.
Rows = tuple[int, int] | None


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
    destination.copy_(loaded_weight)


def default_weight_loader(param: torch.Tensor, loaded_weight, shard_id=None) -> None:
    """The loader of a parameter that is the same on every rank (a norm's weight)."""
    copy_rows(param, loaded_weight)
