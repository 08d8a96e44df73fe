"""The multiprocess executor ("mp"): one worker process per rank on this machine.

Each rank is a process started with multiprocessing's 'spawn', bound to its own CPU cores
(distributed/cpu_binding.py), joined to the others over torch.distributed. A call is pickled
once and the same bytes go down every worker's pipe; every worker answers on its pipe, and
a step's answer is the output rank's (the last pipeline stage's first tensor-parallel rank;
the others answer None). While it waits the executor also watches every worker's process
sentinel: a worker that dies, or a call that raises in one, is a RuntimeError in the engine
core (which then exits, as for any engine error), never a hang.

With several pipeline stages up to that many steps are under way at once (`execute_model(...,
non_block=True)`): each worker answers its calls in the order they came down its pipe, so the
answers are read back oldest step first, and a plain call first reads every step's answer
that is still on its way.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from tokenserve.config import EngineConfig
from tokenserve.distributed.cpu_binding import bind_to_cpus, cpus_for_ranks
from tokenserve.executor.abstract import Executor, PendingOutput, run_method
from tokenserve.messages.model_runner_output import ModelRunnerOutput
from tokenserve.messages.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from tokenserve.structured_output.manager import GrammarBitmask
    from tokenserve.worker.worker import Worker

# The call that ends a worker's loop.
SHUTDOWN = "__shutdown__"
# Seconds a worker is given to leave its loop at shutdown before it is terminated (within
# the 5 s the API server gives the engine core to stop).
_SHUTDOWN_GRACE_S = 2.0


def output_rank(config: EngineConfig) -> int:
    """The rank whose step output is the step's: the last pipeline stage's tensor-parallel
    rank 0 (it sampled)."""
    parallel = config.parallel_config
    return (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size


def encode_call(
    method: str | Callable[..., Any], args: tuple, kwargs: dict, output_only: bool
) -> bytes:
    """One call for every worker, serialized once. `output_only`: only the output rank
    sends its result back (the step's output), the others None."""
    return pickle.dumps((method, args, kwargs, output_only), protocol=pickle.HIGHEST_PROTOCOL)


def answer_call(worker: Worker, payload: bytes, is_output_rank: bool) -> tuple[str, Any]:
    """Run one encoded call on `worker`: ("ok", result) or ("error", the traceback)."""
    method, args, kwargs, output_only = pickle.loads(payload)
    try:
        result = run_method(worker, method, args, kwargs)
    except Exception:  # noqa: BLE001 - the executor re-raises it in the engine core
        return "error", traceback.format_exc()
    return "ok", (None if output_only and not is_output_rank else result)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _exit_when_orphaned(parent_pid: int) -> None:
    """A worker blocked in a collective never reads its pipe again: leave when the engine
    core is gone (its parent process changes)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def run_worker(
    config: EngineConfig, rank: int, init_method: str, cpus: list[int], conn: Connection
) -> None:
    """A worker process's life: bind, join the ranks, load, then answer calls until told to
    stop or the executor's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    bind_to_cpus(cpus)
    from tokenserve.worker.worker import Worker

    try:
        worker = Worker(config, rank, distributed_init_method=init_method)
    except Exception:  # noqa: BLE001 - reported to the executor, which raises it
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ok", None)))
    is_output_rank = rank == output_rank(config)
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the executor is gone
        if pickle.loads(payload)[0] == SHUTDOWN:
            conn.send_bytes(pickle.dumps(("ok", None)))
            break
        conn.send_bytes(pickle.dumps(answer_call(worker, payload, is_output_rank)))
    worker.shutdown()


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """The engine-core process is daemonic (it dies with the API server) and multiprocessing
    refuses children to daemonic processes; its workers are daemonic too, and leave when
    it is gone (_exit_when_orphaned), so the rule's reason does not apply."""
    process_config = multiprocessing.current_process()._config
    daemon = process_config.get("daemon")
    process_config["daemon"] = False
    try:
        yield
    finally:
        process_config["daemon"] = daemon


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """os.environ with `values` while the workers start ('spawn' copies it): each worker's
    OpenMP pool sized before anything in it reads the variable."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class BroadcastExecutor(Executor):
    """An executor of worker processes (or actors) that each get every call as one pickled
    payload (`encode_call`); `_call` delivers it to every rank and returns the answers by
    rank, and the step's output is the output rank's."""

    output_rank: int

    @abstractmethod
    def _call(self, payload: bytes) -> list[Any]:
        """Send `payload` to every worker; their results by rank (a failure: RuntimeError)."""

    @abstractmethod
    def _submit(self, payload: bytes) -> PendingOutput:
        """Send `payload` to every worker without waiting; the output rank's result comes
        from the returned `PendingOutput`."""

    @property
    def max_concurrent_batches(self) -> int:
        """One step per pipeline stage: while the last stage computes a step, the earlier
        ones compute the steps after it."""
        return self.config.parallel_config.pipeline_parallel_size

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """`method` must pickle (a method name, or a function defined at module level)."""
        return self._call(encode_call(method, args, kwargs or {}, output_only=False))

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        grammar_bitmask: GrammarBitmask | None = None,
        non_block: bool = False,
    ) -> ModelRunnerOutput | PendingOutput:
        payload = encode_call("execute_model", (scheduler_output, grammar_bitmask), {}, True)
        if non_block:
            return self._submit(payload)
        return self._call(payload)[self.output_rank]


class _PipeAnswer(PendingOutput):
    """A step on its way through the worker pipes: answered when every older one is."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        self.executor = executor
        self.answered = False
        self.output: ModelRunnerOutput | None = None
        self.error: RuntimeError | None = None

    def result(self) -> ModelRunnerOutput:
        while not self.answered:
            self.executor._read_oldest_answer()
        if self.error is not None:
            raise self.error
        assert self.output is not None
        return self.output


@dataclass
class _WorkerProcess:
    rank: int
    process: multiprocessing.process.BaseProcess
    conn: Connection


class MultiprocExecutor(BroadcastExecutor):
    def __init__(self, config: EngineConfig) -> None:
        try:
            super().__init__(config)
        except BaseException:
            self.shutdown()  # no worker outlives a failed start
            raise

    def _init_executor(self) -> None:
        world_size = self.config.parallel_config.world_size
        cpus = cpus_for_ranks(world_size)  # ValueError: more ranks than cores
        init_method = f"tcp://127.0.0.1:{free_port()}"
        context = multiprocessing.get_context("spawn")
        self.output_rank = output_rank(self.config)
        self.workers: list[_WorkerProcess] = []
        # Steps sent and not yet answered, oldest first (their answers come in this order).
        self.unanswered: deque[_PipeAnswer] = deque()
        with _children_allowed(), _environment(OMP_NUM_THREADS=str(len(cpus[0]))):
            for rank in range(world_size):
                conn, child_conn = context.Pipe()
                process = context.Process(
                    target=run_worker,
                    args=(self.config, rank, init_method, cpus[rank], child_conn),
                    name=f"tokenserve-worker-{rank}",
                    daemon=True,
                )
                process.start()
                child_conn.close()
                self.workers.append(_WorkerProcess(rank, process, conn))
        self._gather()  # every worker joined the ranks and built its runner

    def _call(self, payload: bytes) -> list[Any]:
        while self.unanswered:  # the steps' answers come first down the pipes
            self._read_oldest_answer()
        self._send(payload)
        return self._gather()

    def _submit(self, payload: bytes) -> PendingOutput:
        self._send(payload)
        pending = _PipeAnswer(self)
        self.unanswered.append(pending)
        return pending

    def _send(self, payload: bytes) -> None:
        if not self.workers:
            raise RuntimeError("The executor is shut down.")
        for worker in self.workers:
            try:
                worker.conn.send_bytes(payload)
            except (BrokenPipeError, OSError):
                pass  # a dead worker: _gather names it

    def _read_oldest_answer(self) -> None:
        pending = self.unanswered.popleft()
        try:
            pending.output = self._gather()[self.output_rank]
        except RuntimeError as error:
            pending.error = error
            # The workers are broken: the younger steps get the same error.
            for younger in self.unanswered:
                younger.error, younger.answered = error, True
            self.unanswered.clear()
        pending.answered = True

    def _gather(self) -> list[Any]:
        """Every worker's answer, by rank; RuntimeError for a worker that failed or died."""
        results: dict[int, Any] = {}
        errors: list[str] = []
        pending = {worker.conn: worker for worker in self.workers}
        sentinels = {worker.process.sentinel: worker for worker in self.workers}
        while pending:
            for ready in wait([*pending, *sentinels]):
                worker = pending.pop(ready, None) if ready in pending else None
                if worker is not None:
                    try:
                        status, value = pickle.loads(ready.recv_bytes())
                    except (EOFError, OSError):
                        status, value = "dead", None
                    if status == "ok":
                        results[worker.rank] = value
                        continue
                    if status == "error":
                        errors.append(f"worker rank {worker.rank} failed:\n{value}")
                        continue
                else:
                    worker = sentinels.pop(ready)
                    if worker.conn not in pending or worker.conn.poll():
                        continue  # it answered (or its answer is waiting) before it exited
                    pending.pop(worker.conn)
                worker.process.join(1.0)
                exitcode = worker.process.exitcode
                errors.append(f"worker rank {worker.rank} (pid {worker.process.pid}) died "
                              f"with exit code {exitcode}")
            if errors:
                # The others may be blocked in a collective with it: do not wait for them.
                raise RuntimeError("; ".join(errors))
        return [results[worker.rank] for worker in self.workers]

    def shutdown(self) -> None:
        workers, self.workers = getattr(self, "workers", []), []
        for pending in getattr(self, "unanswered", ()):
            pending.error, pending.answered = RuntimeError("The executor is shut down."), True
        self.unanswered = deque()
        for worker in workers:
            with contextlib.suppress(OSError):
                worker.conn.send_bytes(encode_call(SHUTDOWN, (), {}, False))
        deadline = time.monotonic() + _SHUTDOWN_GRACE_S
        for worker in workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.terminate()
                worker.process.join(_SHUTDOWN_GRACE_S)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
