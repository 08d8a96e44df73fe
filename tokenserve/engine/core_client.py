"""The API process's side of the engine core: talk to it, notice when it dies.

The engine-core process itself is started by core_process.py (`EngineCoreProcess`). The
client binds two ipc:// sockets in the process's private temporary directory (PUSH for
requests, PULL for outputs) and waits for the ready handshake over a pipe. Sends and
receives are asyncio (zmq.asyncio). The process's sentinel is watched on the event loop, so
a dead engine is known at once. This module imports nothing heavy: the engine's modules load
in the child.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from tokenserve.engine.core_process import EngineCoreProcess
from tokenserve.messages.engine_core import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    make_encoder,
    make_outputs_decoder,
)

if TYPE_CHECKING:
    from tokenserve.config import EngineConfig

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served any more."""


class EngineLiveness:
    """Whether an engine client's engine core(s) still run: the first reason one died, kept;
    every call after it fails with EngineDeadError."""

    dead_reason: str | None = None

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            logger.error("%s", reason)

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)


class EngineCoreClient(EngineLiveness):
    def __init__(
        self,
        config: EngineConfig,
        engine_process: EngineCoreProcess | None = None,
        engine_index: int = 0,
        cpu_ids: list[int] | None = None,
        wait: bool = True,
    ) -> None:
        """`engine_process`: one started earlier (configured with `config`, or not yet);
        by default one is started here. `engine_index` and `cpu_ids` (the cores it is
        pinned to) place one engine of several under data parallelism (engine/dp_client.py).
        `wait=False`: return while the engine core still loads; `wait_until_ready` waits."""
        self.engine_process = engine_process or EngineCoreProcess(engine_index)
        if self.engine_process.config is None:
            self.engine_process.configure(config, cpu_ids)
        elif self.engine_process.config is not config:
            raise ValueError("The engine core process was configured with another configuration.")
        self.process = self.engine_process.process
        self.context = zmq.asyncio.Context()
        self.input_socket = self.context.socket(zmq.PUSH)
        self.input_socket.bind(self.engine_process.input_address)
        self.output_socket = self.context.socket(zmq.PULL)
        self.output_socket.bind(self.engine_process.output_address)
        self.encoder = make_encoder()
        self.decoder = make_outputs_decoder()
        self.dead_reason: str | None = None
        self._closing = False
        self._ready = False
        if wait:
            self.wait_until_ready()

    def wait_until_ready(self) -> None:
        """Block until the engine core has loaded its model (once; at once after that). A
        process that failed to start is stopped and its error raised."""
        if self._ready:
            return
        try:
            self.engine_process.wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        self._ready = True

    def watch_process(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(reason)` on the running event loop as soon as the process ends."""
        loop = asyncio.get_running_loop()

        def process_ended() -> None:
            loop.remove_reader(self.process.sentinel)
            self.process.join(timeout=0)
            if not self._closing:
                self.mark_dead(
                    f"The engine core process exited (exit code {self.process.exitcode})."
                )
                on_death(self.dead_reason or "")

        loop.add_reader(self.process.sentinel, process_ended)

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        await self.input_socket.send_multipart(
            [EngineCoreRequestType.ADD.value, self.encoder.encode(request)]
        )

    async def abort_requests(self, request_ids: list[str]) -> None:
        if not request_ids or self.is_dead or self._closing:
            return
        await self.input_socket.send_multipart(
            [EngineCoreRequestType.ABORT.value, self.encoder.encode(request_ids)]
        )

    async def get_outputs(self) -> EngineCoreOutputs:
        """The next message from the engine core (a step's outputs and stats)."""
        self._check_alive()
        outputs = self.decoder.decode(await self.output_socket.recv())
        if outputs.engine_error is not None:
            self.mark_dead(f"The engine core failed: {outputs.engine_error}")
        return outputs

    def shutdown(self) -> None:
        """Stop the engine process (SIGTERM, then SIGKILL) and release the sockets."""
        self._closing = True
        self.engine_process.shutdown()
        self.context.destroy(linger=0)
