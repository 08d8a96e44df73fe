"""The API process's side of the engine core: start it, talk to it, notice when it dies.

The client binds two ipc:// sockets in a private temporary directory (PUSH for requests,
PULL for outputs), starts the engine-core process with multiprocessing's 'spawn' and
waits for its ready handshake over a pipe. Sends and receives are asyncio (zmq.asyncio).
The process's sentinel is watched on the event loop, so a dead engine is known at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from tokenserve.config import EngineConfig
from tokenserve.core.engine_core_proc import run_engine_core
from tokenserve.messages.engine_core import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    make_encoder,
    make_outputs_decoder,
)
from tokenserve.model.loader import load_tokenizer

logger = logging.getLogger(__name__)

# How long a clean shutdown waits for the engine process before killing it.
SHUTDOWN_TIMEOUT_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served any more."""


class EngineCoreClient:
    def __init__(
        self, config: EngineConfig, engine_index: int = 0, cpu_ids: list[int] | None = None
    ) -> None:
        """`engine_index` and `cpu_ids` (the cores it is pinned to) place one engine of
        several under data parallelism (engine/dp_client.py)."""
        self._socket_dir = tempfile.mkdtemp(prefix="tokenserve-")
        input_address = f"ipc://{self._socket_dir}/input"
        output_address = f"ipc://{self._socket_dir}/output"
        self.context = zmq.asyncio.Context()
        self.input_socket = self.context.socket(zmq.PUSH)
        self.input_socket.bind(input_address)
        self.output_socket = self.context.socket(zmq.PULL)
        self.output_socket.bind(output_address)
        self.encoder = make_encoder()
        self.decoder = make_outputs_decoder()
        self.dead_reason: str | None = None
        self._closing = False

        spawn = multiprocessing.get_context("spawn")
        ready_reader, ready_writer = spawn.Pipe(duplex=False)
        self.process = spawn.Process(
            target=run_engine_core,
            args=(
                config,
                input_address,
                output_address,
                ready_writer,
                multiprocessing.current_process().pid,
                functools.partial(
                    load_tokenizer, config.model_config.files, config.model_config.tokenizer
                ),
                engine_index,
                cpu_ids,
            ),
            name="tokenserve-engine-core" + (f"-{engine_index}" if engine_index else ""),
            daemon=True,
        )
        started = time.perf_counter()
        self.process.start()
        ready_writer.close()
        try:
            self._wait_until_ready(ready_reader)
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "Engine core process %d ready in %.1f s.",
            self.process.pid,
            time.perf_counter() - started,
        )

    def _wait_until_ready(self, ready_reader) -> None:
        try:
            message = ready_reader.recv()
        except EOFError:
            raise RuntimeError(
                "The engine core process exited while starting; see its log above."
            ) from None
        finally:
            ready_reader.close()
        if message.get("status") != "ready":
            raise RuntimeError(f"The engine core failed to start: {message.get('error')}")

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

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

    def mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            logger.error("%s", reason)

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

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
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(SHUTDOWN_TIMEOUT_S)
        if self.process.is_alive():
            logger.warning(
                "The engine core did not stop in %.0f s; killing it.", SHUTDOWN_TIMEOUT_S
            )
            self.process.kill()
            self.process.join()
        self.context.destroy(linger=0)
        shutil.rmtree(self._socket_dir, ignore_errors=True)
