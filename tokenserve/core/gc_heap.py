"""What start-up builds, kept out of Python's cyclic garbage collector for the life of a
serving process (the engine core's, the API server's).

The model's modules and parameters, the tokenizer, the HTTP app: ~230k tracked objects in
an engine core process of the default model, alive as long as the process. Left in the
collector's generations, every full collection walks all of them, 70-90 ms of CPU here,
and that pause lands inside an engine step, in every running request's inter-token
latency. Frozen (`gc.freeze`, as vLLM's processes do after start), a collection walks
only what the requests created since.

An offline `LLM` lives in the user's process, whose objects are the user's to drop: there
what exists when a run (`generate`, `encode`, ...) starts is frozen for that run only and
handed back to the collector when it ends, so nothing stays frozen.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_startup_heap(full: bool = True) -> int:
    """Collect what start-up left behind, then freeze the rest; returns how many objects
    the collector no longer walks.

    `full=False` collects only the young generations (the objects made since the last
    collection of the oldest one), for a process whose every moment is on the start's path
    (the engine core's, after "ready"). The full collection walks every object, ~0.1 s for
    the engine core's ~185k, and on the default model finds 20 objects of garbage among
    them: what became garbage after surviving into the oldest generation stays frozen."""
    gc.collect(2 if full else 1)  # 2: every generation
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def heap_frozen_during_run() -> Iterator[None]:
    """Leave every object that exists now out of collections until the block ends, then
    hand them all back (`gc.freeze` and `gc.unfreeze` move whole generations: no walk).
    Does nothing where objects are frozen already: those are not ours to unfreeze."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
