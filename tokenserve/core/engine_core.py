"""The engine core: schedule → execute → update, one step at a time.

It sees token ids only (never text, never HTTP). The offline LLMEngine drives it in
process; a server drives the same class in its own process. It never holds the model:
an executor (executor/abstract.py) runs it on its workers.

Under pipeline parallelism the executor takes up to one step per stage at once
(`max_concurrent_batches`): a step is then scheduled and sent while the steps before it are
still on their way through the stages, and a step call collects the oldest step's output
only once that many are under way or nothing more can be scheduled (a batch queue, as in
vLLM V1's engine core). Outputs are taken in the order the steps were scheduled.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tokenserve.config import EngineConfig
from tokenserve.core.request import Request, RequestStatus
from tokenserve.core.scheduler import Scheduler
from tokenserve.core.step_cost import StepCostModel, StepShape
from tokenserve.executor.abstract import Executor, PendingOutput
from tokenserve.executor.backends import get_executor_class
from tokenserve.kv_transfer.factory import create_scheduler_connector
from tokenserve.messages.engine_core import EngineCoreOutput, SchedulerStats
from tokenserve.messages.model_runner_output import ModelRunnerOutput
from tokenserve.messages.scheduler_output import SchedulerOutput
from tokenserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# How long an idle step waits for a compiling grammar before returning to its caller.
GRAMMAR_WAIT_S = 0.005
# How long an idle step waits while a KV connector copies blocks (P/D) before polling again.
KV_TRANSFER_WAIT_S = 0.002


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        load_tokenizer: Callable[[], Any] | None = None,
        executor_class: type[Executor] | None = None,
    ) -> None:
        """`load_tokenizer` returns the tokenizer, for structured outputs (which call it on
        their first compile); `executor_class` (optional) replaces the one
        `distributed_executor_backend` names."""
        self.config = config
        started = time.perf_counter()
        executor_class = executor_class or get_executor_class(config)
        self.executor = executor_class(config)
        self.executor.initialize_kv_cache()
        # With a target step time, every step's wall time (schedule → execute → update) teaches
        # the cost model the scheduler sizes prefill with. `clock` is replaceable in tests.
        self.step_cost_model: StepCostModel | None = None
        if config.scheduler_config.target_step_ms is not None:
            self.step_cost_model = StepCostModel()
        self.clock = time.perf_counter
        kv_connector = None
        if config.kv_transfer_config is not None:
            kv_connector = create_scheduler_connector(
                config.kv_transfer_config, config.cache_config.block_size
            )
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            self.step_cost_model,
            config.speculative_config,
            config.lora_config,
            kv_connector,
            pipeline_parallel=config.parallel_config.pipeline_parallel_size > 1,
        )
        self.structured_output_manager = StructuredOutputManager(config, load_tokenizer)
        # What the latest step scheduled; the engine-core process reads it for its stats.
        self.last_scheduler_output: SchedulerOutput | None = None
        # Steps sent and not yet collected, oldest first, when pipeline stages overlap them
        # (one at a time with a KV connector, whose loads and saves assume it).
        self.max_concurrent_batches = self.executor.max_concurrent_batches
        if config.kv_transfer_config is not None:
            self.max_concurrent_batches = 1
        self.batch_queue: deque[tuple[PendingOutput, SchedulerOutput]] = deque()
        # Outputs of steps collected outside a step call (before a collective call).
        self.collected_outputs: list[EngineCoreOutput] = []
        logger.info(
            "Engine core ready in %.1f s: %s, %d KV blocks of %d tokens, max_model_len %d.",
            time.perf_counter() - started,
            config.model_config.architecture,
            config.cache_config.num_blocks,
            config.cache_config.block_size,
            config.model_config.max_model_len,
        )

    def add_request(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is not None:
            self.structured_output_manager.add_request(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self.batch_queue)
            or bool(self.collected_outputs)
        )

    def prefault_kv_cache(self, max_seconds: float) -> bool:
        """Between steps only, while nothing is to compute: fault in more of the workers' KV
        cache pages ahead of their first use for about max_seconds (worker/cpu_memory.py),
        so that a later step's K/V writes do not; whether any pages are left."""
        assert not self.has_unfinished_requests(), "only while idle"
        return self.executor.prefault_kv_cache(max_seconds)

    def pack_weights(self) -> None:
        """Pack every weight the workers' loads left unpacked, now: for an engine without
        idle time to do it in (the offline LLM), so that its first steps do not."""
        self.executor.pack_weights()

    def warm_up(self) -> bool:
        """Between steps only, while nothing is to compute: one more piece of the workers'
        warm-up, so that the first step of each size does not pay for it: oneDNN's packing
        of the weights the load left unpacked, the oneDNN primitives for the bf16 products'
        row buckets (worker/product_warm_up.py), then the heap memory a step of the budget's
        tokens allocates and the weights moved onto huge pages (worker/cpu_memory.py,
        `HeapReserve`, `WeightHugePages`); whether any are left."""
        assert not self.has_unfinished_requests(), "only while idle"
        return self.executor.warm_up()

    def step(self) -> list[EngineCoreOutput]:
        if self.max_concurrent_batches > 1:
            return self._step_with_batch_queue()
        if not self.scheduler.has_unfinished_requests():
            return []
        outputs = self._poll_grammars()
        started = self.clock()
        scheduler_output = self.scheduler.schedule()
        self.last_scheduler_output = scheduler_output
        grammar_bitmask = self.structured_output_manager.grammar_bitmask(scheduler_output)
        runner_output = self.executor.execute_model(scheduler_output, grammar_bitmask)
        outputs += self._update_from_output(scheduler_output, runner_output)
        if self.step_cost_model is not None and not scheduler_output.is_empty:
            self.step_cost_model.record(StepShape.of(scheduler_output), self.clock() - started)
        self._wait_if_idle(scheduler_output)
        return outputs

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Schedule and send a step while fewer than `max_concurrent_batches` are under way;
        collect the oldest one when the queue is full or this step scheduled nothing.
        (The step-cost model is not taught here: a step's wall time overlaps others'.)"""
        outputs, self.collected_outputs = self.collected_outputs, []
        self.last_scheduler_output = None
        scheduled = None
        room = len(self.batch_queue) < self.max_concurrent_batches
        if room and self.scheduler.has_unfinished_requests():
            outputs += self._poll_grammars()
            scheduled = self.scheduler.schedule()
            self.last_scheduler_output = scheduled
            if not scheduled.is_empty or _tells_workers_something(scheduled):
                self._send(scheduled)
            if not scheduled.is_empty and len(self.batch_queue) < self.max_concurrent_batches:
                return outputs
        if self.batch_queue:
            pending, scheduler_output = self.batch_queue.popleft()
            outputs += self._update_from_output(scheduler_output, pending.result())
        elif scheduled is not None:
            self._wait_if_idle(scheduled)
        return outputs

    def _send(self, scheduler_output: SchedulerOutput) -> None:
        grammar_bitmask = self.structured_output_manager.grammar_bitmask(scheduler_output)
        pending = self.executor.execute_model(scheduler_output, grammar_bitmask, non_block=True)
        assert isinstance(pending, PendingOutput)
        self.batch_queue.append((pending, scheduler_output))

    def _collect_all(self) -> None:
        """Collect every step under way (before a call that needs the workers idle); their
        outputs go out with the next step call."""
        while self.batch_queue:
            pending, scheduler_output = self.batch_queue.popleft()
            self.collected_outputs += self._update_from_output(scheduler_output, pending.result())

    def _update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if runner_output.draft_token_ids:
            self.scheduler.update_draft_token_ids(runner_output.draft_token_ids)
        return outputs

    def _wait_if_idle(self, scheduler_output: SchedulerOutput) -> None:
        """A step that scheduled nothing waits a moment for what it waits on, not to spin."""
        if not scheduler_output.is_empty:
            return
        if self.structured_output_manager.has_compiling_requests:
            self.structured_output_manager.wait_for_grammars(GRAMMAR_WAIT_S)
        elif self.scheduler.has_pending_kv_transfers:
            time.sleep(KV_TRANSFER_WAIT_S)  # only a KV copy is under way: do not spin

    def _poll_grammars(self) -> list[EngineCoreOutput]:
        """Admit requests whose grammar compiled; end those whose grammar failed ("abort")."""
        failed = self.structured_output_manager.poll_grammars()
        for request in failed:
            assert request.structured_output_request is not None
            logger.error(
                "Request %s: its structured-output grammar failed to compile: %s",
                request.request_id,
                request.structured_output_request.error,
            )
        self.scheduler.finish_requests(
            [r.request_id for r in failed], RequestStatus.FINISHED_ABORTED
        )
        return [
            EngineCoreOutput(r.request_id, [], finish_reason=r.status.finish_reason) for r in failed
        ]

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run a worker method (or `method(worker, ...)`) on every worker: one result each."""
        self._collect_all()
        return self.executor.collective_rpc(method, args, kwargs)

    def shutdown(self) -> None:
        self.batch_queue.clear()
        self.executor.shutdown()
        if self.scheduler.kv_connector is not None:
            self.scheduler.kv_connector.connector.shutdown()


def _tells_workers_something(scheduler_output: SchedulerOutput) -> bool:
    """Whether a step that computes nothing still carries news for the workers: requests to
    forget, encoder outputs to drop, a KV connector's loads or saves."""
    return bool(
        scheduler_output.finished_req_ids
        or scheduler_output.preempted_req_ids
        or scheduler_output.free_encoder_mm_hashes
        or scheduler_output.kv_connector_metadata is not None
    )
