"""The executor interface: how the engine core runs the model without holding it.

An executor owns the workers (one per device rank) and broadcasts calls to them:
`collective_rpc` runs a worker method on every worker and returns one result each;
`execute_model` is the step's call. An executor whose workers form several pipeline stages
runs up to `max_concurrent_batches` steps at once: `execute_model(..., non_block=True)`
returns a `PendingOutput` at once, answered in the order the steps were sent. The engine core imports this interface; the concrete
class is chosen by `EngineConfig.parallel_config.distributed_executor_backend`
(backends.py) and imported only then, so nothing of the worker or the model is loaded
through the core.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenserve.config import EngineConfig
from tokenserve.messages.model_runner_output import ModelRunnerOutput
from tokenserve.messages.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from tokenserve.structured_output.manager import GrammarBitmask


def run_method(
    worker: Any, method: str | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """One worker's part of a collective call: `worker.method(*args, **kwargs)` for a method
    name, `method(worker, *args, **kwargs)` for a callable."""
    if isinstance(method, str):
        return getattr(worker, method)(*args, **kwargs)
    return method(worker, *args, **kwargs)


class PendingOutput(ABC):
    """A step sent to the workers and not yet answered (`execute_model(non_block=True)`)."""

    @abstractmethod
    def result(self) -> ModelRunnerOutput:
        """Wait for the step's output (a failed worker: RuntimeError)."""


class _Answered(PendingOutput):
    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output


class Executor(ABC):
    """Builds the workers and loads the model on construction; then `initialize_kv_cache`,
    one `execute_model` per step, `shutdown` at the end."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()
        self.collective_rpc("load_model")

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers (each builds its model runner, not yet loaded)."""

    @abstractmethod
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run `method` on every worker (see `run_method`); one result per worker, by rank."""

    def initialize_kv_cache(self) -> None:
        """Allocate every worker's KV cache (`cache_config.num_blocks` blocks)."""
        self.collective_rpc("initialize_kv_cache")

    def prefault_kv_cache(self, max_seconds: float) -> bool:
        """Fault in more of each worker's KV cache ahead of its first use for about
        max_seconds (between steps only); whether any worker has pages left."""
        return any(self.collective_rpc("prefault_kv_cache", args=(max_seconds,)))

    def pack_weights(self) -> None:
        """Pack every weight each worker's load left unpacked, now (oneDNN's form)."""
        self.collective_rpc("pack_weights")

    def warm_up(self) -> bool:
        """One more piece of each worker's warm-up (its bf16 product primitives, then the
        heap a full step's activations take) ahead of the steps that need it (between steps
        only); whether any worker has some left."""
        return any(self.collective_rpc("warm_up"))

    @property
    def max_concurrent_batches(self) -> int:
        """How many steps may be under way at once: one, unless pipeline stages overlap."""
        return 1

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        grammar_bitmask: GrammarBitmask | None = None,
        non_block: bool = False,
    ) -> ModelRunnerOutput | PendingOutput:
        """Run one step on every worker; the first rank's output is the step's. With
        `non_block`, a `PendingOutput` (here already answered: one worker runs one step)."""
        output = self.collective_rpc("execute_model", args=(scheduler_output, grammar_bitmask))[0]
        return _Answered(output) if non_block else output

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release what they hold."""
