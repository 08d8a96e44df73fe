"""The engine core in its own process: ZMQ in, busy loop, ZMQ out.

Three threads, one job each. The input thread receives msgpack messages on a PULL
socket and queues them decoded; the main thread steps the `EngineCore` while there is
work and blocks on that queue when there is none; the output thread encodes and sends
each step's outputs and scheduler stats on a PUSH socket. The API process binds both
sockets and starts this process (`tokenserve/engine/core_client.py`); if it goes away,
this process notices and exits. Nothing here ever sees text.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from tokenserve.config import EngineConfig
from tokenserve.core.cpu_threads import pin_to_cpus
from tokenserve.core.dashboard_snapshot import SnapshotClock, dashboard_snapshot, num_decode_tokens
from tokenserve.core.engine_core import EngineCore
from tokenserve.core.gc_heap import freeze_startup_heap
from tokenserve.core.request import Request
from tokenserve.core.step_cost import StepShape
from tokenserve.executor.backends import import_executor_class
from tokenserve.messages.engine_core import (
    EngineCoreOutputs,
    EngineCoreRequestType,
    make_abort_decoder,
    make_encoder,
    make_request_decoder,
)

logger = logging.getLogger(__name__)

# How often the input thread checks that the API process is still alive.
PARENT_POLL_INTERVAL_MS = 1000
# How long the output socket may keep unsent messages when the process exits.
SOCKET_LINGER_MS = 2000

ENGINE_CORE_LOG_FORMAT = "%(levelname)s %(asctime)s [engine core] %(name)s: %(message)s"

_SHUTDOWN = "shutdown"  # an input-queue item that ends the busy loop
# Time given to faulting the KV cache in per call while idle, in pieces of at most 256 KiB
# (worker/cpu_memory.py): an input arriving meanwhile waits for the rest of the slice and one
# piece at most, ~2 ms where fresh memory is cheap, ~5 ms where a page costs ~45 us
# (docs/PERFORMANCE_CPU.md). A whole block of the default model's cache (~3 MiB) took 1-32
# ms on that VM.
PREFAULT_SLICE_SECONDS = 0.002


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    ready_pipe: Connection,
    parent_pid: int,
    load_tokenizer: Callable[[], Any] | None = None,
    engine_index: int = 0,
    cpu_ids: list[int] | None = None,
) -> None:
    """The process entry point: build the engine core, report ready, loop until told to stop.
    `load_tokenizer` returns the tokenizer for structured outputs (picklable: the API
    process passes it, as the engine core does not import model code). `cpu_ids`: the
    cores this engine runs on (data parallelism); None: all of the process's cores."""
    name = "engine core" if engine_index == 0 and cpu_ids is None else f"engine core {engine_index}"
    # force: a process started before its configuration logged with the plain name already.
    logging.basicConfig(
        level=logging.INFO, format=ENGINE_CORE_LOG_FORMAT.replace("engine core", name), force=True
    )
    # Ctrl-C reaches the whole process group; the API server decides how to stop us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        if cpu_ids is not None:
            pin_to_cpus(cpu_ids)
        engine_core = EngineCore(config, load_tokenizer)
    except BaseException as error:  # the parent must learn why, whatever it was
        ready_pipe.send({"status": "failed", "error": f"{type(error).__name__}: {error}"})
        ready_pipe.close()
        raise
    proc = EngineCoreProc(engine_core, input_address, output_address, parent_pid)
    # The configuration it runs, for the API process to check against its own.
    ready_pipe.send({"status": "ready", "pid": os.getpid(), "config": config})
    ready_pipe.close()
    # After "ready" the first request is on its way: no full collection delays it.
    freeze_startup_heap(full=False)
    exit_code = 0
    try:
        proc.run_busy_loop()
    except SystemExit:
        logger.info("Engine core shutting down.")
    except BaseException as error:  # reported to the API process; the exit code says it too
        logger.exception("Engine core failed.")
        proc.send_error(f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
        exit_code = 1
    finally:
        proc.close()
        engine_core.shutdown()
    # Everything is flushed and closed; skip the interpreter's teardown (seconds with torch
    # loaded), which would only delay the API process joining us.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def run_engine_core_when_configured(
    start_pipe: Connection,
    ready_pipe: Connection,
    parent_pid: int,
    configure: Callable[[Any], tuple[EngineConfig, Callable[[], Any] | None]],
) -> None:
    """The entry point of a process started before its configuration existed
    (engine/core_client.py): the default executor's modules are imported while the API
    process parses the flags; then `configure` turns what the API process sends (the engine
    arguments, or a configuration) into the configuration and the tokenizer's loader, and
    `run_engine_core` runs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=ENGINE_CORE_LOG_FORMAT)
    import_executor_class("uni")
    logger.info("Engine core process: modules imported.")  # bench startup's "import" mark
    try:
        settings, input_address, output_address, engine_index, cpu_ids = start_pipe.recv()
    except EOFError:  # the API process stopped before configuring us (bad flags, Ctrl-C)
        os._exit(0)
    finally:
        start_pipe.close()
    try:
        config, load_tokenizer = configure(settings)
    except (ValueError, OSError, RuntimeError) as error:  # bad flags: the API process says so
        ready_pipe.send({"status": "failed", "error": f"{type(error).__name__}: {error}"})
        ready_pipe.close()
        os._exit(1)
    logger.info("Engine core process: configured.")  # bench startup's "configured" mark
    run_engine_core(
        config, input_address, output_address, ready_pipe, parent_pid, load_tokenizer,
        engine_index, cpu_ids,
    )


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


class EngineCoreProc:
    def __init__(
        self, engine_core: EngineCore, input_address: str, output_address: str, parent_pid: int
    ) -> None:
        self.engine_core = engine_core
        self.parent_pid = parent_pid
        self.input_queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.output_queue: queue.Queue[EngineCoreOutputs | None] = queue.Queue()
        # Requests added but not yet scheduled, for their queue time.
        self.unscheduled_request_ids: set[str] = set()
        # Whether a warm-up (bf16 product primitives, the heap of a full step) may be left to
        # do, and KV cache pages to fault in, while idle.
        self.warming = True
        self.prefaulting = True
        # /dashboard's block map and queues ride on the stats a few times a second.
        self.snapshot_clock = SnapshotClock()
        self.context = zmq.Context()
        self.input_thread = threading.Thread(
            target=self._receive_inputs,
            args=(input_address,),
            name="engine-core-input",
            daemon=True,
        )
        self.output_thread = threading.Thread(
            target=self._send_outputs,
            args=(output_address,),
            name="engine-core-output",
            daemon=True,
        )
        self.input_thread.start()
        self.output_thread.start()

    # ---- main thread ---------------------------------------------------------------

    def run_busy_loop(self) -> None:
        """Step while there is work; wait on the input queue while there is none."""
        while True:
            if not self.engine_core.has_unfinished_requests():
                # Idle: publish the final state (e.g. blocks freed by an abort), then wait.
                self._publish(EngineCoreOutputs())
                if not self._handle_input(*self._next_input_while_idle()):
                    return
            while not self.input_queue.empty():
                if not self._handle_input(*self.input_queue.get_nowait()):
                    return
            self._step()

    def _next_input_while_idle(self) -> tuple[str, Any]:
        """The next input. Until it comes, idle time goes to what later steps would
        otherwise pay for, a small piece at a time (an input waits for one piece at most):
        first the warm-up (the bf16 products' oneDNN primitives, one product per piece, then
        the heap of a full step's activations, 2 MiB a piece), then the KV cache's pages,
        PREFAULT_SLICE_SECONDS a piece; once all is done, block on the queue."""
        while self.warming or self.prefaulting:
            try:
                return self.input_queue.get_nowait()
            except queue.Empty:
                if self.warming:
                    self.warming = self.engine_core.warm_up()
                else:
                    self.prefaulting = self.engine_core.prefault_kv_cache(PREFAULT_SLICE_SECONDS)
        return self.input_queue.get()

    def _handle_input(self, kind: str, payload: Any) -> bool:
        """Apply one input; False means shut down."""
        if kind == _SHUTDOWN:
            return False
        if kind == EngineCoreRequestType.ADD.name:
            try:
                self.engine_core.add_request(Request.from_engine_core_request(payload))
            except ValueError as error:
                # The API process makes unique ids; this only guards the invariant.
                logger.error("Refused request %s: %s", payload.request_id, error)
                return True
            self.unscheduled_request_ids.add(payload.request_id)
        elif kind == EngineCoreRequestType.ABORT.name:
            self.engine_core.abort_requests(payload)
            self.unscheduled_request_ids.difference_update(payload)
        return True

    def _step(self) -> None:
        started = time.time()
        outputs = self.engine_core.step()
        scheduler_output = self.engine_core.last_scheduler_output
        first_scheduled_times: dict[str, float] = {}
        num_scheduled_tokens = num_decode = num_pairs = 0
        if scheduler_output is not None:
            num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
            num_decode = num_decode_tokens(scheduler_output)
            num_pairs = StepShape.of(scheduler_output).attention_pairs
            for new_request in scheduler_output.scheduled_new_reqs:
                if new_request.request_id in self.unscheduled_request_ids:
                    self.unscheduled_request_ids.discard(new_request.request_id)
                    first_scheduled_times[new_request.request_id] = started
        self._publish(
            EngineCoreOutputs(
                outputs=outputs,
                num_scheduled_tokens=num_scheduled_tokens,
                num_decode_tokens=num_decode,
                num_attention_pairs=num_pairs,
                first_scheduled_times=first_scheduled_times,
            )
        )

    def _publish(self, message: EngineCoreOutputs) -> None:
        message.timestamp = time.time()
        message.scheduler_stats = self.engine_core.make_stats()
        # Always after the last step before idling, so the dashboard shows the final state.
        idle = not self.engine_core.has_unfinished_requests()
        if self.snapshot_clock.due(force=idle):
            message.scheduler_stats.dashboard = dashboard_snapshot(self.engine_core.scheduler)
        self.output_queue.put(message)

    def send_error(self, error: str) -> None:
        self.output_queue.put(EngineCoreOutputs(timestamp=time.time(), engine_error=error))

    def close(self) -> None:
        """Flush what is queued for the API process, then close the sockets."""
        self.output_queue.put(None)
        self.output_thread.join(timeout=SOCKET_LINGER_MS / 1000)
        if self.output_thread.is_alive():
            return  # Stuck sending to an API process that is gone: exiting ends the thread.
        # Terminating the context wakes the input thread (ContextTerminated); it closes its socket.
        self.context.term()

    # ---- input thread --------------------------------------------------------------

    def _receive_inputs(self, address: str) -> None:
        request_decoder = make_request_decoder()
        abort_decoder = make_abort_decoder()
        socket = self.context.socket(zmq.PULL)
        socket.connect(address)
        try:
            while True:
                if not socket.poll(PARENT_POLL_INTERVAL_MS):
                    if os.getppid() != self.parent_pid:
                        logger.error("The API process is gone; the engine core stops.")
                        self.input_queue.put((_SHUTDOWN, None))
                        return
                    continue
                kind, payload = socket.recv_multipart()
                try:
                    request_type = EngineCoreRequestType(kind)
                    decoder = (
                        request_decoder
                        if request_type is EngineCoreRequestType.ADD
                        else abort_decoder
                    )
                    self.input_queue.put((request_type.name, decoder.decode(payload)))
                except (ValueError, msgspec.DecodeError) as error:
                    logger.error("Dropped a malformed message: %s", error)
        except zmq.ContextTerminated:
            return
        finally:
            socket.close(linger=0)

    # ---- output thread -------------------------------------------------------------

    def _send_outputs(self, address: str) -> None:
        encoder = make_encoder()
        socket = self.context.socket(zmq.PUSH)
        socket.connect(address)
        try:
            while (message := self.output_queue.get()) is not None:
                socket.send(encoder.encode(message))
        except zmq.ContextTerminated:
            return
        finally:
            socket.close(linger=SOCKET_LINGER_MS)
