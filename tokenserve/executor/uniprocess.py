"""The executor of one worker in the engine core's own process: calls are plain calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenserve.executor.abstract import Executor, run_method
from tokenserve.worker.worker import Worker


class UniprocessExecutor(Executor):
    def _init_executor(self) -> None:
        self.driver_worker: Worker | None = Worker(self.config, rank=0)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        if self.driver_worker is None:
            raise RuntimeError("The executor is shut down.")
        return [run_method(self.driver_worker, method, args, kwargs or {})]

    def shutdown(self) -> None:
        if self.driver_worker is not None:
            self.driver_worker.shutdown()
        self.driver_worker = None
