"""Executor backends by name (`distributed_executor_backend`): the class is imported only
when chosen, so whoever picks one imports nothing of the others or of the workers."""

from __future__ import annotations

from tokenserve.config import DISTRIBUTED_EXECUTOR_BACKENDS, EngineConfig
from tokenserve.executor.abstract import Executor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    return import_executor_class(config.parallel_config.distributed_executor_backend)


def import_executor_class(backend: str) -> type[Executor]:
    """The class of a backend by name, imported (with its workers and model code) now."""
    if backend == "uni":
        from tokenserve.executor.uniprocess import UniprocessExecutor

        return UniprocessExecutor
    if backend == "mp":
        from tokenserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from tokenserve.executor.ray_executor import RayExecutor

        return RayExecutor
    raise ValueError(
        f"distributed_executor_backend must be one of {list(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
        f"got {backend!r}."
    )
