"""The engine-core process, started before its configuration exists.

`EngineCoreProcess` starts the engine-core process with multiprocessing's 'spawn': the
child imports the engine (torch, the executor) while the API process parses flags.
`configure_from_args` then hands it the engine arguments (plain data), from which it builds
its configuration and loads the model while the API process builds the same configuration
and imports the HTTP stack; the ready handshake checks that the two agree (docs/STARTUP.md).
`tokenserve serve` starts it first thing, so this module imports only the standard library
(no asyncio, zmq or messages: core_client.py talks to the process once it runs): the child
starts that much sooner, and the engine's modules load in the child only.
"""

from __future__ import annotations

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

if TYPE_CHECKING:
    from tokenserve.config import EngineConfig
    from tokenserve.engine.engine_args import EngineArgs

logger = logging.getLogger(__name__)

# How long a clean shutdown waits for the engine process before killing it.
SHUTDOWN_TIMEOUT_S = 5.0


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
