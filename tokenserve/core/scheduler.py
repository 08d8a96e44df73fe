"""The token-budget scheduler: each step, which requests advance and by how many tokens.

One rule: bring each request's `num_computed_tokens` up to its `num_tokens`. Running
requests go first (so decodes keep priority), then waiting ones while the token budget,
`max_num_seqs` and free KV blocks allow. A prompt longer than the remaining budget is
split across steps (chunked prefill). When a running request needs a block and none is
free, the newest (or lowest-priority) running request is preempted: it gives back its
blocks and waits to be recomputed. Nobody is admitted in a step that preempted.
With a target step time (`target_step_ms`), a `TargetStepBudget` caps the prompt tokens
of each step on top of its decodes (core/step_cost.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokenserve.config import CacheConfig, SchedulerConfig
from tokenserve.core.kv_cache_manager import KVCacheManager
from tokenserve.core.request import Request, RequestStatus
from tokenserve.core.request_queue import create_request_queue
from tokenserve.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenserve.core.step_cost import PrefillBudget, StepCostModel, StepShape, TargetStepBudget
from tokenserve.sample.logprobs import LogprobsLists

# With a target step time, the prompt tokens a step gets however slow its decodes are.
MIN_PREFILL_TOKENS = 16


@dataclass
class EngineCoreOutput:
    """What one step produced for one request (token ids only: no text here)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # One position per new token, when the request asked for logprobs.
    new_logprobs: LogprobsLists | None = None
    # Every prompt position but the first, once, with the first new token.
    new_prompt_logprobs: LogprobsLists | None = None


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # The latest step's token budget: max_num_batched_tokens, or with a target step time
    # its decode rows plus what a fresh prompt could get under the target.
    token_budget: int | None = None
    # The step-cost model's prediction for the latest step (target step time only).
    predicted_step_ms: float | None = None


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        step_cost_model: StepCostModel | None = None,
    ) -> None:
        """`step_cost_model`: what sizes each step's prefill under `target_step_ms` (the
        engine core records into it); one is made if the config has a target and none is given."""
        self.config = scheduler_config
        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_blocks,
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.prefix_caching_hash_algo,
        )
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        # Requests finished since the last schedule(), for the runner to forget.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.step_cost_model = step_cost_model
        if scheduler_config.target_step_ms is not None and step_cost_model is None:
            self.step_cost_model = StepCostModel()
        self.min_prefill_tokens = min(
            max(MIN_PREFILL_TOKENS, cache_config.block_size),
            scheduler_config.max_num_batched_tokens,
        )
        self.last_token_budget = scheduler_config.max_num_batched_tokens
        self.last_predicted_step_ms: float | None = None

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, or a stop string found by the detokenizer)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ---- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        token_budget = self.config.max_num_batched_tokens
        prefill_budget = self._prefill_budget()
        num_scheduled_tokens: dict[str, int] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        preempted: list[Request] = []
        new_block_ids: dict[str, list[int]] = {}

        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            if num_new_tokens > 1:  # a prompt chunk; a decode row always gets its token
                num_new_tokens = prefill_budget.grant(request.num_computed_tokens, num_new_tokens)
                if num_new_tokens == 0:
                    index += 1
                    continue
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    break
                victim = self._choose_victim()
                if victim in num_scheduled_tokens:
                    # Already scheduled this step (priority policy): give its budget back.
                    token_budget += num_scheduled_tokens.pop(victim.request_id)
                    scheduled_running.remove(victim)
                    index -= 1
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            scheduled_running.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            new_block_ids[request.request_id] = [block.block_id for block in new_blocks]
            token_budget -= num_new_tokens
            index += 1

        if not preempted:
            # Requests whose grammar is still compiling; they keep their place in the queue.
            skipped: list[Request] = []
            while (
                len(self.waiting) > 0
                and token_budget > 0
                and len(self.running) < self.config.max_num_seqs
            ):
                request = self.waiting.peek()
                if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                    skipped.append(self.waiting.pop())
                    continue
                hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
                num_new_tokens = request.num_tokens - num_hit_tokens
                if not self.config.enable_chunked_prefill and num_new_tokens > token_budget:
                    break
                num_new_tokens = min(num_new_tokens, token_budget)
                num_new_tokens = prefill_budget.grant(num_hit_tokens, num_new_tokens)
                if num_new_tokens == 0:
                    break
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, hits, num_hit_tokens
                )
                if new_blocks is None:
                    break
                self.waiting.pop()
                self.kv_cache_manager.prefix_cache_stats.record(request.num_tokens, num_hit_tokens)
                request.num_computed_tokens = num_hit_tokens
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit_tokens
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = time.time()
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                scheduled_new.append(request)
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens
            for request in reversed(skipped):
                self.waiting.prepend(request)

        output = SchedulerOutput(
            scheduled_new_reqs=[self._new_request_data(r) for r in scheduled_new],
            scheduled_cached_reqs=[
                CachedRequestData(r.request_id, new_block_ids[r.request_id], r.num_computed_tokens)
                for r in scheduled_running
            ],
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
        )
        for request in (*scheduled_running, *scheduled_new):
            request.num_computed_tokens += num_scheduled_tokens[request.request_id]
        self.finished_req_ids = set()
        self.last_token_budget = prefill_budget.token_budget or self.config.max_num_batched_tokens
        if isinstance(prefill_budget, TargetStepBudget) and not output.is_empty:
            self.last_predicted_step_ms = prefill_budget.cost_model.predict_ms(StepShape.of(output))
        return output

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: dict[str, list[int]],
        logprobs: dict[str, LogprobsLists] | None = None,
        prompt_logprobs: dict[str, LogprobsLists] | None = None,
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        logprobs = logprobs or {}
        prompt_logprobs = prompt_logprobs or {}
        outputs = []
        for request_id, new_token_ids in sampled_token_ids.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # Aborted or preempted while the step ran.
            request.append_output_token_ids(new_token_ids)
            if request.structured_output_request is not None:
                request.structured_output_request.accept_tokens(
                    request_id, request.output_token_ids, len(new_token_ids)
                )
            self._check_stop(request)
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    new_logprobs=logprobs.get(request_id),
                    new_prompt_logprobs=prompt_logprobs.get(request_id),
                )
            )
            if request.is_finished:
                self.running.remove(request)
                self._free_request(request)
        return outputs

    def make_stats(self) -> SchedulerStats:
        stats = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            num_preemptions=self.num_preemptions,
            token_budget=self.last_token_budget,
            predicted_step_ms=self.last_predicted_step_ms,
        )

    # ---- helpers -------------------------------------------------------------------

    def _prefill_budget(self) -> PrefillBudget:
        """This step's limit on prompt tokens: none, unless a target step time sets one."""
        target_ms = self.config.target_step_ms
        if target_ms is None or self.step_cost_model is None or not self.step_cost_model.is_ready:
            return PrefillBudget()
        decode_shape = StepShape()
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens == 1:
                decode_shape.add(request.num_computed_tokens, 1)
        return TargetStepBudget(
            self.step_cost_model,
            target_ms,
            decode_shape,
            self.min_prefill_tokens,
            self.config.max_num_batched_tokens,
            chunked=self.config.enable_chunked_prefill,
        )

    def _check_stop(self, request: Request) -> None:
        params = request.sampling_params
        last_token = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last_token == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if last_token in (params.stop_token_ids or ()):
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last_token
                return
        if request.structured_output_request is not None and (
            request.structured_output_request.is_terminated()
        ):
            # The grammar is complete and accepted its stop token (even with ignore_eos).
            request.status = RequestStatus.FINISHED_STOPPED
            return
        if (params.max_tokens is not None and request.num_output_tokens >= params.max_tokens) or (
            request.num_tokens >= self.config.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED

    def _choose_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=Request.sort_key)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            eos_token_id=request.eos_token_id,
        )
