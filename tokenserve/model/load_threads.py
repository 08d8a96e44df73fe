"""How a model load uses the cores: its torch threads and its worker threads.

Loading a model is hundreds of small operations that need not wait for each other: a copy
per weight into fresh memory, the GGUF blocks joined, oneDNN's reorder of each projection;
most of their time is page faults. Through torch's OpenMP pool each operation ends at a
barrier where every thread waits for the others, and while another process computes on the
same cores (the API process importing its stack during a `tokenserve serve`, other jobs on
a shared machine) one of the pool's threads is often descheduled and the others spin at the
barrier for its time slice (the default model's load took 4-6 s that way, docs/STARTUP.md).
So a small model's load runs each operation on one torch thread and hands the operations to
as many worker threads as torch has: a descheduled worker delays only the operation it holds,
and the other takes the next. A large model keeps the pool, one operation at a time, where
each operation's work outweighs the barrier. Threads change no result: every operation is a
copy, a cast or a reorder of its own tensors.

A load that packs frees memory (the dense weights once packed), and the workers'
allocations (packed weights, joined blocks) come from their own malloc arenas, so the holes
left in the main one are not reused: after the load glibc's `malloc_trim` hands the arenas'
free memory back (~400 MB of RSS on the default model, in ~40 ms, when it packs at load).
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

# Up to this many bytes of parameters a model loads on one torch thread per operation.
ONE_THREAD_MAX_BYTES = 2 << 30
# Operations queued per worker at most: the tensors a queued copy reads stay in memory until
# it runs (a fresh expansion's, for one), so the loop that submits them waits beyond this.
QUEUED_PER_WORKER = 4


def parameter_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's parameters and buffers as built (before packing)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


class LoadWorkers:
    """Runs a load's operations on `count` threads (in the caller's thread for one), at most
    QUEUED_PER_WORKER per worker queued (`submit` waits for the oldest beyond); `wait`
    returns once all submitted have run, raising the first failed one's error."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._executor = ThreadPoolExecutor(count, "model-load") if count > 1 else None
        self._pending: deque[Future] = deque()
        self._error: BaseException | None = None

    def submit(self, operation: Callable[..., object], *args: object) -> None:
        if self._executor is None:
            operation(*args)
            return
        if len(self._pending) >= self.count * QUEUED_PER_WORKER:
            self._settle(self._pending.popleft())
        self._pending.append(self._executor.submit(operation, *args))

    def wait(self) -> None:
        while self._pending:
            self._settle(self._pending.popleft())
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _settle(self, future: Future) -> None:
        error = future.exception()  # waits for the operation
        if error is not None and self._error is None:
            self._error = error

    def close(self) -> None:
        """Let what is running finish (a failed load's other copies too); start no more."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()


@contextmanager
def load_threads(model: torch.nn.Module) -> Iterator[LoadWorkers]:
    """The workers a load of `model` runs its operations on: as many as torch has threads,
    each operation on one torch thread, for a small model; one, on torch's pool, for a large
    one. Torch gets its thread count back afterwards."""
    threads = torch.get_num_threads()
    small = parameter_bytes(model) <= ONE_THREAD_MAX_BYTES
    workers = LoadWorkers(threads if small else 1)
    with torch_threads(1 if small else threads):
        try:
            yield workers
        finally:
            workers.close()
    return_free_memory()


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block on `count` torch threads, then give torch its count back."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def return_free_memory() -> None:
    """Give the free memory of every malloc arena back to the system (glibc; elsewhere a
    no-op)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols: libc's
    except (OSError, AttributeError):
        return
    trim(0)
