"""What start-up builds, kept out of Python's cyclic garbage collector for the life of a
serving process (the engine core's, the API server's).

The model's modules and parameters, the tokenizer, the HTTP app: ~230k tracked objects in
an engine core process of the default model, alive as long as the process. Left in the
collector's generations, every full collection walks all of them, ~50 ms of CPU here,
and that pause lands inside an engine step, in every running request's inter-token
latency. Frozen (`gc.freeze`, as vLLM's processes do after start), a collection walks
only what the requests created since. Only for processes that end with the engine: an
offline `LLM` in the user's process is left alone, as its objects are the user's to drop.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then freeze the rest; returns how many objects
    the collector no longer walks."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
