"""Putting checkpoint tensors into parameters: what every layer's weight loader ends in.

Inside a load (`copies_submitted_to`) a checkpoint tensor marked `mark_aliasable` (a view
of a weight-cache entry's private mapping, model/weight_cache.py) is not copied at once:
its parameter becomes a view of the tensor's memory instead, where every row of the
parameter comes from such tensors lying one after another in one storage (q, k and v
of a merged projection written side by side), in the parameter's dtype. A parameter
whose rows come otherwise gets the copies, as outside a load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

# Where a shard goes in a parameter's rows: (first row, number of rows); None: all of them.
Rows = tuple[int, int] | None

# The attribute `mark_aliasable` sets on a checkpoint tensor.
_ALIASABLE = "tokenserve_aliasable"


def mark_aliasable(tensor: torch.Tensor) -> torch.Tensor:
    """Mark a checkpoint tensor as memory a parameter may keep as its own: nothing else
    writes it, and it lives as long as a view of it does (a private mapping of a file that
    is replaced, never rewritten). Returns the tensor."""
    setattr(tensor, _ALIASABLE, True)
    return tensor


# A marked checkpoint tensor held for a parameter: (its first row there, the rows it fills,
# the tensor).
_Piece = tuple[int, torch.Tensor, torch.Tensor]


class _Load:
    """The copies of one load: the unmarked ones submitted at once, the marked ones held
    per parameter until `finish` sees all of its rows."""

    def __init__(self, submit: Callable[..., None]) -> None:
        self.submit = submit
        # id(param) -> (param, its marked pieces)
        self.held: dict[int, tuple[torch.Tensor, list[_Piece]]] = {}
        # id(param) of each parameter a row of which came unmarked (copied at once)
        self.copied: set[int] = set()

    def copy(self, param: torch.Tensor, destination: torch.Tensor, first: int,
             loaded_weight: torch.Tensor) -> None:
        if getattr(loaded_weight, _ALIASABLE, False):
            self.held.setdefault(id(param), (param, []))[1].append(
                (first, destination, loaded_weight))
        else:
            self.copied.add(id(param))
            self.submit(destination.copy_, loaded_weight)

    def finish(self) -> None:
        for key, (param, pieces) in self.held.items():
            view = None if key in self.copied else _view_over(param, pieces)
            if view is not None:
                param.data = view
                continue
            for _, destination, weight in pieces:
                self.submit(destination.copy_, weight)
        self.held.clear()


def _view_over(param: torch.Tensor, pieces: list[_Piece]) -> torch.Tensor | None:
    """A tensor of param's shape over the pieces' memory, where they fill its rows one after
    another in one storage, in its dtype; else None."""
    if not pieces or param.dim() == 0 or not param.is_contiguous():
        return None
    pieces = sorted(pieces, key=lambda piece: piece[0])
    start = pieces[0][2]
    storage = start.untyped_storage().data_ptr()
    row_elements = param[0].numel()
    row = 0
    for first, _, weight in pieces:
        if (first != row or weight.dtype != param.dtype or not weight.is_contiguous()
                or weight.untyped_storage().data_ptr() != storage
                or weight.storage_offset() != start.storage_offset() + row * row_elements):
            return None
        row += weight.shape[0]
    if row != param.shape[0]:
        return None
    return start.as_strided(param.shape, param.stride(), start.storage_offset())


# The load that copy_rows hands its copies to inside `copies_submitted_to` (None: it copies
# at once). A context, as torch.no_grad is, because the weight loaders that end in copy_rows
# are many and nested, and their (param, weight, shard_id) signature is the models' contract.
_load: ContextVar[_Load | None] = ContextVar("load", default=None)


@contextmanager
def copies_submitted_to(submit: Callable[..., None]) -> Iterator[None]:
    """Within the block copy_rows checks each weight's shape at once and passes its copy to
    `submit(copy, source)` (a load's worker threads, model/load_threads.py), or holds a
    marked one (`mark_aliasable`) until the block ends, which makes each parameter filled
    by marked ones a view of them and submits the copies of the rest. The caller waits for
    the copies before reading the parameters."""
    load = _Load(submit)
    token = _load.set(load)
    try:
        yield
    finally:
        _load.reset(token)
    load.finish()


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
    load = _load.get()
    if load is None:
        destination.copy_(loaded_weight)
    else:
        load.copy(param, destination, 0 if rows is None else rows[0], loaded_weight)


def default_weight_loader(param: torch.Tensor, loaded_weight, shard_id=None) -> None:
    """The loader of a parameter that is the same on every rank (a norm's weight)."""
    copy_rows(param, loaded_weight)
