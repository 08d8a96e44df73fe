"""Data parallelism: N engine-core processes behind one API process, as one client.

`DataParallelCoreClient` has `EngineCoreClient`'s surface, so `AsyncLLM` does not know
how many engines it drives. It starts one `EngineCoreClient` per engine (concurrently),
each pinned to its own share of this process's CPU cores; each engine has its own KV
cache and prefix cache. New requests go where `DataParallelRouter` says (least loaded,
prefix affinity), aborts go to the engine that holds the request, and the engines'
messages are read in turns from one poll over their output sockets, each stamped with
its `engine_index` (the engine label of /metrics). One engine's death is the client's
death: every request fails and /health answers 503, as with a single engine.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import zmq
import zmq.asyncio

from tokenserve.config import EngineConfig
from tokenserve.engine.core_client import EngineCoreClient, EngineLiveness
from tokenserve.engine.core_process import EngineCoreProcess
from tokenserve.engine.dp_router import DataParallelRouter
from tokenserve.messages.engine_core import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)


def split_cpus(num_engines: int, cpu_ids: list[int]) -> list[list[int]]:
    """Distinct cores per engine, as many each (the remainder unused); ValueError when
    there are fewer cores than engines."""
    if num_engines > len(cpu_ids):
        raise ValueError(
            f"data_parallel_size {num_engines} needs at least {num_engines} CPU cores (one "
            f"per engine core); this process may use {len(cpu_ids)}: {sorted(cpu_ids)}."
        )
    per_engine = len(cpu_ids) // num_engines
    ordered = sorted(cpu_ids)
    return [ordered[index * per_engine : (index + 1) * per_engine] for index in range(num_engines)]


def make_engine_core_client(
    config: EngineConfig, engine_process: EngineCoreProcess | None = None, wait: bool = True
) -> EngineCoreClient | DataParallelCoreClient:
    """One engine core (in `engine_process` when one was started earlier), or
    `data_parallel_size` of them behind a router. `wait=False`: one engine core may still be
    loading when this returns (the client's `wait_until_ready` waits); data-parallel engines
    are always ready."""
    if config.parallel_config.data_parallel_size > 1:
        if engine_process is not None:
            raise ValueError("Data parallelism starts its own engine core processes.")
        return DataParallelCoreClient(config)
    return EngineCoreClient(config, engine_process, wait=wait)


class DataParallelCoreClient(EngineLiveness):
    def __init__(self, config: EngineConfig) -> None:
        num_engines = config.parallel_config.data_parallel_size
        cpu_sets = split_cpus(num_engines, sorted(os.sched_getaffinity(0)))
        self.router = DataParallelRouter(num_engines, config.cache_config.block_size)
        self.engines: list[EngineCoreClient] = []
        self.dead_reason: str | None = None
        # Started together (each loads the model on its own cores); leaving the pool waits.
        with ThreadPoolExecutor(max_workers=num_engines) as pool:
            futures = [
                pool.submit(EngineCoreClient, config, None, index, cpus)
                for index, cpus in enumerate(cpu_sets)
            ]
        self.engines = [future.result() for future in futures if future.exception() is None]
        errors = [error for future in futures if (error := future.exception()) is not None]
        if errors:  # the engines that did start must stop
            self.shutdown()
            raise errors[0]
        self.poller = zmq.asyncio.Poller()
        self._engine_by_socket: dict[zmq.Socket, int] = {}
        for index, engine in enumerate(self.engines):
            self.poller.register(engine.output_socket, zmq.POLLIN)
            self._engine_by_socket[engine.output_socket] = index
        self._readable: collections.deque[int] = collections.deque()
        self._first_in_turn = 0  # the engine read first after the next poll
        logger.info("%d data-parallel engine cores on CPU cores %s.", num_engines, cpu_sets)

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    def wait_until_ready(self) -> None:
        """Nothing to wait for: the engines were ready when this client was built."""

    def watch_process(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(reason)` once, as soon as any engine's process ends."""

        def engine_ended(index: int, reason: str) -> None:
            if self.dead_reason is None:
                self.mark_dead(f"Data-parallel engine {index}: {reason}")
                on_death(self.dead_reason or reason)

        for index, engine in enumerate(self.engines):
            engine.watch_process(lambda reason, index=index: engine_ended(index, reason))

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        lora_name = request.lora_request.lora_name if request.lora_request else None
        index = self.router.route(
            request.request_id, request.prompt_token_ids, request.cache_salt, lora_name
        )
        try:
            await self.engines[index].add_request(request)
        except BaseException:
            self.router.finish(request.request_id)
            raise

    async def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = collections.defaultdict(list)
        for request_id in request_ids:
            index = self.router.finish(request_id)
            if index is not None:
                by_engine[index].append(request_id)
        if self.is_dead:
            return
        for index, engine_request_ids in by_engine.items():
            await self.engines[index].abort_requests(engine_request_ids)

    async def get_outputs(self) -> EngineCoreOutputs:
        """The next message of any engine; engines with messages waiting take turns."""
        self._check_alive()
        while not self._readable:
            events = await self.poller.poll()
            ready = {self._engine_by_socket[socket] for socket, _ in events}
            turn = [(self._first_in_turn + offset) % self.num_engines for offset in range(self.num_engines)]
            self._readable.extend(index for index in turn if index in ready)
            self._first_in_turn = (self._first_in_turn + 1) % self.num_engines
        index = self._readable.popleft()
        engine = self.engines[index]
        outputs = await engine.get_outputs()
        outputs.engine_index = index
        if engine.dead_reason is not None:
            self.mark_dead(f"Data-parallel engine {index}: {engine.dead_reason}")
        for output in outputs.outputs:
            if output.finish_reason is not None:
                self.router.finish(output.request_id)
        return outputs

    def shutdown(self) -> None:
        """Stop every engine process and release the sockets."""
        for engine in self.engines:
            engine.shutdown()
