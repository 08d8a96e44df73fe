"""AsyncLLM: the asyncio engine the API server uses, with the engine core in its own process.

`generate()` tokenizes and validates in this process (Processor), sends the request to
the engine core, and yields the request's RequestOutputs as they come. One output-handler
task receives every engine-core message, detokenizes it (OutputProcessor) and puts each
request's output into that request's collector. A collector holds at most one pending
output: when its consumer reads slowly, DELTA outputs merge instead of piling up.
Cancelling or closing a `generate()` aborts its request in the engine core, and so does
closing a `RequestOutputStream` that was never read (a client gone before its first event).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import operator
from collections.abc import AsyncGenerator
from typing import Any

from tokenserve.config import EngineConfig
from tokenserve.engine.core_client import EngineDeadError
from tokenserve.engine.core_process import EngineCoreProcess
from tokenserve.engine.dp_client import make_engine_core_client
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.engine.output_processor import OutputProcessor
from tokenserve.engine.parallel_sampling import fan_out
from tokenserve.engine.processor import Processor, PromptType
from tokenserve.lora.request import LoRARequest
from tokenserve.messages.engine_core import SchedulerStats
from tokenserve.metrics.log_stats import LOG_INTERVAL_S, LoggingStatLogger
from tokenserve.metrics.request_trace import RequestObserver
from tokenserve.metrics.stats import RequestStatsTracker, StatLogger
from tokenserve.model.loader import load_tokenizer
from tokenserve.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from tokenserve.pooling_params import PoolingParams
from tokenserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class RequestOutputCollector:
    """The hand-over point between the output handler and one request's consumer."""

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.output_kind = output_kind
        self.pending: RequestOutput | PoolingRequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | PoolingRequestOutput | BaseException) -> None:
        pending = self.pending
        if (
            isinstance(item, RequestOutput)
            and isinstance(pending, RequestOutput)
            and self.output_kind == RequestOutputKind.DELTA
        ):
            merge_delta_outputs(pending, item)
        elif not isinstance(pending, BaseException):
            # CUMULATIVE and FINAL_ONLY outputs supersede each other; an error is final.
            self.pending = item
        self.ready.set()

    async def get(self) -> RequestOutput | PoolingRequestOutput:
        while self.pending is None:
            await self.ready.wait()
        item, self.pending = self.pending, None
        self.ready.clear()
        if isinstance(item, BaseException):
            raise item
        return item


def merge_delta_outputs(pending: RequestOutput, new: RequestOutput) -> None:
    """Append `new` (a DELTA output) to `pending`, an undelivered one of the same request."""
    by_index = {completion.index: completion for completion in pending.outputs}
    for completion in new.outputs:
        if completion.index in by_index:
            _merge_completion(by_index[completion.index], completion)
        else:
            pending.outputs.append(completion)
    for field in dataclasses.fields(RequestOutput):
        value = getattr(new, field.name)
        if field.name != "outputs" and value is not None:
            setattr(pending, field.name, value)


def _merge_completion(pending: CompletionOutput, new: CompletionOutput) -> None:
    # Text and per-token lists are deltas; everything else (finish reason, cumulative
    # log-probability, ...) takes the newest value.
    for field in dataclasses.fields(CompletionOutput):
        old_value, value = getattr(pending, field.name), getattr(new, field.name)
        if isinstance(old_value, (str, list)) and type(value) is type(old_value):
            setattr(pending, field.name, operator.concat(old_value, value))
        elif value is not None:
            setattr(pending, field.name, value)


class RequestOutputStream:
    """One request's outputs, as an async iterator that cannot leak its request.

    Unlike an async generator, which runs no cleanup if it is closed before its first
    step, closing this aborts the request whenever it has not finished, read or not. A
    read that fails or is cancelled aborts it too.
    """

    def __init__(
        self, engine: AsyncLLM, request_id: str, collector: RequestOutputCollector
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.collector = collector
        self.finished = False
        self.closed = False

    def __aiter__(self) -> RequestOutputStream:
        return self

    async def __anext__(self) -> RequestOutput | PoolingRequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        try:
            output = await self.collector.get()
        except BaseException:
            await self.aclose()
            raise
        self.finished = output.finished
        return output

    async def aclose(self) -> None:
        if not (self.finished or self.closed):
            self.closed = True
            self.engine.abort(self.request_id)


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool = True,
        stat_loggers: list[StatLogger] | None = None,
        request_observers: list[RequestObserver] | None = None,
        engine_process: EngineCoreProcess | None = None,
        wait_for_engine: bool = True,
    ) -> None:
        """`request_observers` hear of each engine-core request's arrival, every message of
        the engine core and aborts (`--request-trace`, /dashboard); `engine_process`: an
        engine-core process started earlier (core_process.py), loading while this one starts.
        `wait_for_engine=False`: return while the engine core may still be loading (the
        server builds its app meanwhile); call `wait_until_ready` before serving."""
        self.config = config
        self.tokenizer = load_tokenizer(config.model_config.files, config.model_config.tokenizer)
        self.processor = Processor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats_tracker = RequestStatsTracker()
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        if log_stats:
            self.stat_loggers.append(LoggingStatLogger())
        self.request_observers: list[RequestObserver] = list(request_observers or [])
        self.collectors: dict[str, RequestOutputCollector] = {}
        # The engine core's latest scheduler stats (None before its first message).
        self.scheduler_stats: SchedulerStats | None = None
        # One engine core, or data_parallel_size of them behind a router (engine/dp_client.py).
        self.engine_core = make_engine_core_client(config, engine_process, wait=wait_for_engine)
        self._background_tasks: set[asyncio.Task[Any]] = set()
        self._output_handler: asyncio.Task[None] | None = None
        self._death_callbacks: list[Any] = []

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(engine_args.create_engine_config(), **kwargs)

    # ---- lifecycle -----------------------------------------------------------------

    def wait_until_ready(self) -> None:
        """Block until the engine core(s) can take requests (at once if they already can)."""
        self.engine_core.wait_until_ready()

    def start(self) -> None:
        """Start the output handler and the stats log on the running loop (idempotent)."""
        if self._output_handler is not None:
            return
        self._output_handler = asyncio.create_task(self._handle_outputs(), name="output-handler")
        self._spawn(self._log_stats_periodically())
        self.engine_core.watch_process(self._on_engine_dead)

    def on_engine_dead(self, callback: Any) -> None:
        """Call `callback()` once the engine core has died."""
        self._death_callbacks.append(callback)

    @property
    def is_dead(self) -> bool:
        return self.engine_core.is_dead

    @property
    def dead_reason(self) -> str | None:
        return self.engine_core.dead_reason

    def shutdown(self) -> None:
        for task in (self._output_handler, *self._background_tasks):
            if task is not None:
                task.cancel()
        self.engine_core.shutdown()
        for observer in self.request_observers:
            observer.close()

    # ---- requests ------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs until it finishes; closing the generator aborts it.

        Raises ValueError for invalid input (nothing reaches the engine core) and
        EngineDeadError when the engine core is gone.
        """
        collector = await self.add_request(
            request_id, prompt, sampling_params, priority, cache_salt, arrival_time, lora_request
        )
        async with contextlib.aclosing(self.iterate_outputs(request_id, collector)) as outputs:
            async for output in outputs:
                yield output

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling request's one output (vLLM's `encode`); closing the generator aborts it."""
        collector = await self.add_request(request_id, prompt, pooling_params, priority, cache_salt)
        async with contextlib.aclosing(self.iterate_outputs(request_id, collector)) as outputs:
            async for output in outputs:
                assert isinstance(output, PoolingRequestOutput)
                yield output

    def iterate_outputs(
        self, request_id: str, collector: RequestOutputCollector
    ) -> RequestOutputStream:
        """The outputs of a request added with `add_request`; closing this aborts it."""
        return RequestOutputStream(self, request_id, collector)

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutputCollector:
        if self.engine_core.is_dead:
            raise EngineDeadError(self.engine_core.dead_reason)
        self.start()
        if request_id in self.collectors:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        prompt_text, request = self.processor.process(
            request_id, prompt, params, arrival_time, priority, cache_salt, lora_request
        )
        self.output_processor.add_request(
            request_id,
            prompt_text,
            request.prompt_token_ids,
            request.pooling_params or request.sampling_params,
            request.arrival_time,
        )
        collector = RequestOutputCollector(request.sampling_params.output_kind)
        self.collectors[request_id] = collector
        try:
            # n > 1: the children go to the engine core together, to share the prompt's blocks.
            for core_request in fan_out(request):
                self.stats_tracker.add_request(
                    core_request.request_id, request.arrival_time, request.num_prompt_tokens
                )
                for observer in self.request_observers:
                    observer.add_request(
                        core_request.request_id, core_request.prompt_token_ids, request.arrival_time
                    )
                await self.engine_core.add_request(core_request.to_engine_core_request())
        except BaseException:
            self.abort(request_id)
            raise
        return collector

    @property
    def num_unfinished_requests(self) -> int:
        """Engine-core requests added and not yet finished (a request with n > 1 counts n)."""
        processor = self.output_processor
        return len(processor.request_states) + len(processor.pooling_states)

    def abort(self, request_id: str) -> None:
        """Drop a request here and in the engine core (its blocks are freed there)."""
        if self.collectors.pop(request_id, None) is None:
            return
        core_request_ids = self.output_processor.abort_requests([request_id])
        self.stats_tracker.drop_requests(core_request_ids)
        for observer in self.request_observers:
            observer.drop_requests(core_request_ids)
        self._spawn(self.engine_core.abort_requests(core_request_ids))

    # ---- the output handler --------------------------------------------------------

    async def _handle_outputs(self) -> None:
        try:
            while True:
                message = await self.engine_core.get_outputs()
                if message.engine_error is not None:
                    self._on_engine_dead(self.engine_core.dead_reason or message.engine_error)
                    return
                processed = self.output_processor.process_outputs(message.outputs)
                for output in processed.request_outputs:
                    collector = self.collectors.get(output.request_id)
                    if collector is not None:
                        collector.put(output)
                        if output.finished:
                            del self.collectors[output.request_id]
                if processed.reqs_to_abort:
                    await self.engine_core.abort_requests(processed.reqs_to_abort)
                if message.scheduler_stats is not None:
                    self.scheduler_stats = message.scheduler_stats
                iteration_stats = self.stats_tracker.update(message, processed.reqs_to_abort)
                for stat_logger in self.stat_loggers:
                    stat_logger.record(message.scheduler_stats, iteration_stats)
                for observer in self.request_observers:
                    observer.record(message)
        except asyncio.CancelledError:
            raise
        except EngineDeadError:
            return
        except Exception as error:  # every waiting request must hear of it
            logger.exception("The output handler failed.")
            self.engine_core.mark_dead(f"The output handler failed: {error!r}")
            self._on_engine_dead(self.engine_core.dead_reason or "")

    def _on_engine_dead(self, reason: str) -> None:
        """Fail every waiting request at once, then tell whoever asked (the server)."""
        error = EngineDeadError(reason)
        for request_id, collector in list(self.collectors.items()):
            collector.put(error)
            self.abort(request_id)
        if self._output_handler is not None and self._output_handler is not asyncio.current_task():
            self._output_handler.cancel()
        for callback in self._death_callbacks:
            callback()
        self._death_callbacks.clear()

    async def _log_stats_periodically(self) -> None:
        while True:
            await asyncio.sleep(LOG_INTERVAL_S)
            for stat_logger in self.stat_loggers:
                stat_logger.log()

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background_tasks.add(task)
        task.add_done_callback(self._background_tasks.discard)
