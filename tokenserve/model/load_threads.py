"""How many torch threads a model load runs on.

Loading a model is hundreds of small operations (a copy per weight into fresh memory, the
GGUF blocks joined, oneDNN's reorder of each projection). With torch's OpenMP pool each one
ends at a barrier where every thread waits for the others; while another process computes
on the same cores (the API process importing its stack during a `tokenserve serve`, other
jobs on a shared machine) one of the pool's threads is often descheduled and the others
spin at the barrier for its time slice. On the default model (a few hundred MB of
parameters, 2 cores, other processes busy beside it) the load took 4-6 s with two threads
and 0.46 s of CPU with one (docs/STARTUP.md). A small model's load therefore runs on one
thread; a large one keeps the pool, where each operation's work outweighs the barrier.
Threads change no result: every operation here is a copy, a cast or a reorder.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Up to this many bytes of parameters a model loads on one thread.
ONE_THREAD_MAX_BYTES = 2 << 30


def parameter_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's parameters and buffers as built (before packing)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


@contextmanager
def load_threads(model: torch.nn.Module) -> Iterator[int]:
    """Run the block with the threads a load of `model` gets (one for a small model), then
    give torch its previous thread count back; yields the count used."""
    previous = torch.get_num_threads()
    threads = 1 if parameter_bytes(model) <= ONE_THREAD_MAX_BYTES else previous
    if threads == previous:
        yield previous
        return
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(previous)
