"""The API process's side of the engine core: start it, talk to it, notice when it dies.

`EngineCoreProcess` starts the engine-core process with multiprocessing's 'spawn' before
its configuration exists: the child imports the engine (torch, the executor) while this
process parses flags. `configure_from_args` then hands it the engine arguments (plain
data), from which it builds its configuration and loads the model while this process
builds the same configuration and imports the HTTP stack; the ready handshake checks that
the two agree (`tokenserve serve` starts it first thing, docs/STARTUP.md). The client binds two ipc:// sockets in the process's private
temporary directory (PUSH for requests, PULL for outputs) and waits for the ready
handshake over a pipe. Sends and receives are asyncio (zmq.asyncio). The process's
sentinel is watched on the event loop, so a dead engine is known at once. This module
imports nothing heavy: the engine's modules load in the child.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from tokenserve.messages.engine_core import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    make_encoder,
    make_outputs_decoder,
)

if TYPE_CHECKING:
    from tokenserve.config import EngineConfig
    from tokenserve.engine.engine_args import EngineArgs

logger = logging.getLogger(__name__)

# How long a clean shutdown waits for the engine process before killing it.
SHUTDOWN_TIMEOUT_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served any more."""


def _engine_core_main(start_pipe: Connection, ready_pipe: Connection, parent_pid: int) -> None:
    """The child's entry point; the engine's modules are imported here, in the child only."""
    from tokenserve.core.engine_core_proc import run_engine_core_when_configured

    run_engine_core_when_configured(start_pipe, ready_pipe, parent_pid, _configuration)


def _configuration(
    settings: EngineConfig | EngineArgs,
) -> tuple[EngineConfig, Callable[[], object]]:
    """In the child: its configuration (built from the engine arguments, or as sent) and the
    loader of the tokenizer, for structured outputs (the engine core imports no model code)."""
    from tokenserve.config import EngineConfig
    from tokenserve.model.loader import load_tokenizer

    config = settings if isinstance(settings, EngineConfig) else settings.create_engine_config()
    model_config = config.model_config
    return config, functools.partial(load_tokenizer, model_config.files, model_config.tokenizer)


class EngineCoreProcess:
    """The engine-core process, started now and configured later (`configure`).
    `engine_index`: which of several engines under data parallelism (engine/dp_client.py)."""

    def __init__(self, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self._socket_dir = tempfile.mkdtemp(prefix="tokenserve-")
        self.input_address = f"ipc://{self._socket_dir}/input"
        self.output_address = f"ipc://{self._socket_dir}/output"
        self.config: EngineConfig | None = None
        spawn = multiprocessing.get_context("spawn")
        start_reader, self._start_writer = spawn.Pipe(duplex=False)
        self.ready_reader, ready_writer = spawn.Pipe(duplex=False)
        self.process = spawn.Process(
            target=_engine_core_main,
            args=(start_reader, ready_writer, os.getpid()),
            name="tokenserve-engine-core" + (f"-{engine_index}" if engine_index else ""),
            daemon=True,
        )
        self.started = time.perf_counter()
        self.process.start()
        start_reader.close()
        ready_writer.close()

    def configure_from_args(self, engine_args: EngineArgs) -> None:
        """Hand the process the engine arguments: it builds its configuration from them and
        loads the model while this process builds its own, which `configure` then records
        and the ready handshake checks against the process's."""
        self._send(engine_args, None)

    def configure(self, config: EngineConfig, cpu_ids: list[int] | None = None) -> None:
        """Record the configuration; unless `configure_from_args` was called, hand it to the
        process, which loads the model from here on, pinned to `cpu_ids` when given (data
        parallelism), else on all of the process's cores."""
        if self.config is not None:
            raise RuntimeError("The engine core process is configured already.")
        self.config = config
        if not self._start_writer.closed:
            self._send(config, cpu_ids)

    def _send(self, settings: EngineConfig | EngineArgs, cpu_ids: list[int] | None) -> None:
        if self._start_writer.closed:
            raise RuntimeError("The engine core process is configured already.")
        try:
            self._start_writer.send(
                (settings, self.input_address, self.output_address, self.engine_index, cpu_ids)
            )
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died while importing: the ready handshake reports that
        finally:
            self._start_writer.close()

    def wait_until_ready(self) -> None:
        try:
            message = self.ready_reader.recv()
        except EOFError:
            raise RuntimeError(
                "The engine core process exited while starting; see its log above."
            ) from None
        finally:
            self.ready_reader.close()
        if message.get("status") != "ready":
            raise RuntimeError(f"The engine core failed to start: {message.get('error')}")
        if message.get("config") != self.config:
            # Both were built by the same code from the same arguments and files: a file
            # replaced in between, or an environment that differs, would show here.
            raise RuntimeError(
                "The engine core process built another configuration than the API process "
                "(was the model replaced while the server started?)."
            )
        logger.info(
            "Engine core process %d ready %.1f s after it started.",
            self.process.pid,
            time.perf_counter() - self.started,
        )

    def shutdown(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and remove its socket directory."""
        if not self._start_writer.closed:
            self._start_writer.close()  # never configured: it exits on its own
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(SHUTDOWN_TIMEOUT_S)
        if self.process.is_alive():
            logger.warning(
                "The engine core did not stop in %.0f s; killing it.", SHUTDOWN_TIMEOUT_S
            )
            self.process.kill()
            self.process.join()
        shutil.rmtree(self._socket_dir, ignore_errors=True)


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
    ) -> None:
        """`engine_process`: one started earlier (configured with `config`, or not yet);
        by default one is started here. `engine_index` and `cpu_ids` (the cores it is
        pinned to) place one engine of several under data parallelism (engine/dp_client.py)."""
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
        try:
            self.engine_process.wait_until_ready()
        except BaseException:
            self.shutdown()
            raise

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
