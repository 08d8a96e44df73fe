"""The token-budget scheduler: each step, which requests advance and by how many tokens.

One rule: bring each request's `num_computed_tokens` up to its `num_tokens`. A step is
composed in two passes:
1. Decode rows first: every running request with one token to compute gets it, wherever
   it stands in `running`, with the draft tokens proposed after it (speculative decoding)
   as far as the budget goes.
2. Prompt chunks next, from what the token budget has left: running requests still
   computing their prompt and the waiting requests at the head of the queue (as many as
   `max_num_seqs` leaves room for), fewest remaining prompt tokens first, ties by
   arrival, preempted requests right after the running prompts
   (`prefill_order="shortest"`, under the fcfs policy); or running prompts first, then
   the queue (`prefill_order="arrival"`, and always under the priority policy). Shortest
   first holds `oldest_prompt_share` of the prompt tokens for the running prompt that
   arrived first, so short prompts that keep arriving cannot hold a long one back. A
   prompt longer than what is left is split across steps (chunked prefill); a waiting
   request is admitted after its longest cached prefix.
A waiting request is admitted only if the blocks the running requests and it are projected
to hold over their next `admission_lookahead_tokens` tokens fit the pool (kv_lookahead.py).
When a running request needs a block and none is free, the newest (or lowest-priority)
running request is preempted: it gives back its blocks and waits to be recomputed.
Under pipeline parallelism several steps are under way at once: a request whose tokens are
all under way has none to compute and waits for its step to come back, and a request in a
step under way is preempted only once that step is back (the request that needs its blocks
waits until then).
Admission and preemption never share a step. With a target step time (`target_step_ms`),
a `TargetStepBudget` caps the prompt tokens of each step on top of its decodes
(core/step_cost.py), except in a step where the cap would leave a waiting request it could
admit without a token: a backlog takes full steps, as without a target.
A prompt chunk over an image's placeholders needs the image's encoder output: it is run
in the step (within `max_num_encoder_input_tokens`) or found in the encoder cache, else
the chunk stops before the image (core/encoder_cache_manager.py).
After the step, each sampled request takes its new tokens one by one up to its first stop
(core/stop_checks.py); drafts the model rejected are taken back from `num_computed_tokens`.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

from tokenserve.config import (
    PREFILL_ORDERS,
    CacheConfig,
    LoRAConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenserve.core.encoder_cache_manager import (
    EncoderCacheManager,
    EncoderInputs,
    EncoderPlan,
    commit_encoder_inputs,
    free_computed_encoder_inputs,
    schedule_encoder_inputs,
)
from tokenserve.core.kv_cache_manager import KVCacheManager
from tokenserve.core.kv_connector_hooks import SchedulerConnectorHooks
from tokenserve.core.kv_lookahead import admission_fits
from tokenserve.core.lora_admission import admissible_by_adapter
from tokenserve.core.request import Request, RequestStatus
from tokenserve.core.request_queue import create_request_queue, order_for_prefill
from tokenserve.core.step_cost import PrefillBudget, StepCostModel, StepShape, TargetStepBudget
from tokenserve.core.stop_checks import append_until_stop
from tokenserve.kv_transfer.base import KVConnectorScheduler
from tokenserve.messages.engine_core import (
    EngineCoreOutput,
    LogprobsLists,
    SchedulerStats,
    SpecDecodingStats,
)
from tokenserve.messages.model_runner_output import ModelRunnerOutput
from tokenserve.messages.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

# With a target step time, the prompt tokens a step gets however slow its decodes are.
MIN_PREFILL_TOKENS = 16


@dataclass
class StepPlan:
    """What `schedule()` has decided so far in one step."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_running: list[Request] = field(default_factory=list)
    scheduled_new: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Blocks a running request got this step (the runner appends them to its table).
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # The images whose encoder runs this step, within the encoder budget.
    encoder: EncoderPlan = field(default_factory=lambda: EncoderPlan(0))

    def add_running(self, request: Request, num_new_tokens: int, new_block_ids: list[int]) -> None:
        self.scheduled_running.append(request)
        self.new_block_ids[request.request_id] = new_block_ids
        self._take(request, num_new_tokens)

    def add_new(self, request: Request, num_new_tokens: int) -> None:
        self.scheduled_new.append(request)
        self._take(request, num_new_tokens)

    def add_preempted(self, request: Request) -> None:
        """A request preempted this step: if it was already scheduled, its tokens go back."""
        assert request not in self.scheduled_new, "a step that admits never preempts"
        if request.request_id in self.num_scheduled_tokens:
            self.token_budget += self.num_scheduled_tokens.pop(request.request_id)
            self.scheduled_running.remove(request)
            del self.new_block_ids[request.request_id]
        self.preempted.append(request)

    def _take(self, request: Request, num_new_tokens: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_new_tokens
        self.token_budget -= num_new_tokens


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        step_cost_model: StepCostModel | None = None,
        speculative_config: SpeculativeConfig | None = None,
        lora_config: LoRAConfig | None = None,
        kv_connector: KVConnectorScheduler | None = None,
        pipeline_parallel: bool = False,
    ) -> None:
        """`step_cost_model`: what sizes each step's prefill under `target_step_ms` (the
        engine core records into it); one is made if the config has a target and none is given.
        `speculative_config`: drafts are verified (and counted) only under one.
        `lora_config`: a step holds at most its `max_loras` adapters (core/lora_admission.py).
        `kv_connector`: an external KV store or peer (kv_transfer/; core/kv_connector_hooks.py).
        `pipeline_parallel`: the runner's stages before the last learn the sampled tokens from
        the steps that compute them (`CachedRequestData.new_token_ids`)."""
        if scheduler_config.prefill_order not in PREFILL_ORDERS:
            raise ValueError(
                f"prefill_order must be 'shortest' or 'arrival', "
                f"got {scheduler_config.prefill_order!r}."
            )
        self.config = scheduler_config
        self.lora_config = lora_config
        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_blocks,
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.prefix_caching_hash_algo,
        )
        self.requests: dict[str, Request] = {}
        # Which images' encoder outputs the workers hold (multimodal models).
        self.encoder_cache_manager = EncoderCacheManager(scheduler_config.encoder_cache_size)
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        # Requests finished since the last schedule(), for the runner to forget.
        self.finished_req_ids: set[str] = set()
        # Steps scheduled and not yet answered, per request (pipeline stages overlap steps).
        self.num_steps_under_way: dict[str, int] = {}
        self.pipeline_parallel = pipeline_parallel
        self.num_preemptions = 0
        self.step_cost_model = step_cost_model
        if scheduler_config.target_step_ms is not None and step_cost_model is None:
            self.step_cost_model = StepCostModel()
        self.min_prefill_tokens = min(MIN_PREFILL_TOKENS, scheduler_config.max_num_batched_tokens)
        self.last_token_budget = scheduler_config.max_num_batched_tokens
        self.last_predicted_step_ms: float | None = None
        self.speculative_config = speculative_config
        self.num_lookahead_tokens = 0
        self.spec_decoding_stats: SpecDecodingStats | None = None
        if speculative_config is not None:
            self.num_lookahead_tokens = speculative_config.num_lookahead_tokens
            self.spec_decoding_stats = SpecDecodingStats(speculative_config.num_speculative_tokens)
        self.kv_connector: SchedulerConnectorHooks | None = None
        if kv_connector is not None:
            self.kv_connector = SchedulerConnectorHooks(kv_connector, self.kv_cache_manager)

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
        """Also while a KV connector copies blocks: steps report when the copy ends."""
        return bool(self.running) or len(self.waiting) > 0 or self.has_pending_kv_transfers

    @property
    def has_pending_kv_transfers(self) -> bool:
        return self.kv_connector is not None and self.kv_connector.has_pending_transfers

    # ---- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(self.config.max_num_batched_tokens)
        plan.encoder = EncoderPlan(self.config.max_num_encoder_input_tokens)
        prefill_budget = target = self._prefill_budget()
        if self._schedule_decodes(plan):
            prompts = self._prompt_order(plan)
            if isinstance(target, TargetStepBudget) and self._target_leaves_waiting(plan, prompts):
                prefill_budget = PrefillBudget()  # a backlog: a full step, as without a target
            self._schedule_prompt_chunks(plan, prefill_budget, prompts)

        scheduled_drafts = self._take_drafts(plan)
        output = SchedulerOutput(
            scheduled_new_reqs=[self._new_request_data(r) for r in plan.scheduled_new],
            scheduled_cached_reqs=[
                CachedRequestData(
                    r.request_id,
                    plan.new_block_ids[r.request_id],
                    r.num_computed_tokens,
                    self._sampled_tokens_of_step(r, plan.num_scheduled_tokens[r.request_id]),
                )
                for r in plan.scheduled_running
            ],
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            scheduled_spec_decode_tokens=scheduled_drafts,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in plan.preempted},
            scheduled_encoder_inputs=plan.encoder.inputs,
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
        )
        for request in (*plan.scheduled_running, *plan.scheduled_new):
            request.num_computed_tokens += plan.num_scheduled_tokens[request.request_id]
            under_way = self.num_steps_under_way
            under_way[request.request_id] = under_way.get(request.request_id, 0) + 1
            if request.mm_features:
                free_computed_encoder_inputs(self.encoder_cache_manager, request)
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_metadata(
                [*plan.scheduled_running, *plan.scheduled_new], plan.num_scheduled_tokens
            )
        self.finished_req_ids = set()
        self.last_token_budget = prefill_budget.token_budget or self.config.max_num_batched_tokens
        if isinstance(target, TargetStepBudget) and not output.is_empty:
            self.last_predicted_step_ms = target.cost_model.predict_ms(StepShape.of(output))
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append each sampled request's new tokens up to its first stop, free finished requests.

        A request's new tokens are checked one by one (EOS, stop token ids, the grammar,
        max_tokens, max_model_len); those after a stop are dropped, with their logprobs.
        """
        outputs = []
        for request_id in scheduler_output.num_scheduled_tokens:
            if self.num_steps_under_way.get(request_id, 0) <= 1:
                self.num_steps_under_way.pop(request_id, None)
            else:
                self.num_steps_under_way[request_id] -= 1
        if self.kv_connector is not None:
            failed_running, failed_waiting = self.kv_connector.take_output(
                model_runner_output.kv_connector_output, self.requests
            )
            self._recompute_failed_loads(failed_running)
            outputs += self._fail_remote_loads(failed_waiting)
        for request_id, generated in zip(
            model_runner_output.req_ids, model_runner_output.sampled_token_ids
        ):
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # Aborted or preempted while the step ran.
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id, [])
            assert 1 <= len(generated) <= len(drafts) + 1, "accepted drafts plus one token"
            # Rejected drafts were computed for nothing: their slots are written again later.
            request.num_computed_tokens -= len(drafts) + 1 - len(generated)
            if drafts and self.spec_decoding_stats is not None:
                self.spec_decoding_stats.observe(len(drafts), len(generated) - 1)
            new_token_ids = append_until_stop(request, generated, self.config.max_model_len)
            logprobs = model_runner_output.logprobs.get(request_id)
            if logprobs is not None and len(new_token_ids) < len(generated):
                logprobs = _first_positions(logprobs, len(new_token_ids))
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    new_logprobs=logprobs,
                    new_prompt_logprobs=model_runner_output.prompt_logprobs.get(request_id),
                )
            )
            if request.is_finished:
                self.running.remove(request)
                outputs[-1].kv_transfer_params = self._free_request(request)
        for request_id, pooled in model_runner_output.pooler_output.items():
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                outputs.append(self._finish_pooling(request, pooled))
        return outputs

    def _finish_pooling(self, request: Request, pooled: list[float]) -> EngineCoreOutput:
        """A pooling request ends with its prompt: its pooled result is its only output."""
        request.status = RequestStatus.FINISHED_STOPPED
        self.running.remove(request)
        self._free_request(request)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=request.status.finish_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            pooling_output=pooled,
        )

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Take a proposer's draft tokens (they replace earlier ones): a running request
        verifies them in the next step that schedules it (speculative decoding's hook).
        A structured-output request keeps the drafts its grammar accepts."""
        for request_id, token_ids in draft_token_ids.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            token_ids = list(token_ids)
            if request.structured_output_request is not None:
                token_ids = request.structured_output_request.valid_drafts(token_ids)
            request.spec_token_ids = token_ids

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
            spec_decoding_stats=self.spec_decoding_stats.copy()
            if self.spec_decoding_stats is not None
            else None,
            kv_connector_stats=self.kv_connector.connector.stats.copy()
            if self.kv_connector is not None
            else None,
        )

    # ---- composing a step ----------------------------------------------------------

    def _schedule_decodes(self, plan: StepPlan) -> bool:
        """Give every decode row (one token to compute) its token, before any prompt chunk.

        False when a decode row had to preempt itself: no block is left, the step is done.
        """
        for request in [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]:
            if plan.token_budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted this step, for an earlier row
            num_new_tokens = 1 + self._num_drafts(request, plan.token_budget - 1)
            if not self._schedule_running(request, num_new_tokens, plan, may_preempt=True):
                return False
        return True

    def _num_drafts(self, request: Request, room: int) -> int:
        """How many of a decode row's drafts its step verifies: as many as `room` tokens
        hold, none at a position no request computes (max_model_len - 1 and on: a request
        ends when its token at max_model_len - 1 is appended), none while more requests run
        than speculative decoding's `disable_by_batch_size`."""
        spec = self.speculative_config
        if spec is not None and not spec.speculates(len(self.running)):
            return 0
        room = min(room, self.config.max_model_len - 1 - request.num_tokens)
        return max(0, min(len(request.spec_token_ids), room))

    def _take_drafts(self, plan: StepPlan) -> dict[str, list[int]]:
        """The drafts each scheduled request verifies this step. A step that computes a
        request consumes its drafts: after it they no longer follow its last token."""
        scheduled_drafts = {}
        for request in (*plan.scheduled_running, *plan.scheduled_new):
            num_pending = request.num_tokens - request.num_computed_tokens
            num_drafts = plan.num_scheduled_tokens[request.request_id] - num_pending
            if num_drafts > 0:
                scheduled_drafts[request.request_id] = request.spec_token_ids[:num_drafts]
            request.spec_token_ids = []
        return scheduled_drafts

    def _prompt_order(self, plan: StepPlan) -> list[Request]:
        """The prompts this step may grant tokens to: running requests still computing theirs
        and the admission window's waiting requests, in `order_for_prefill` (shortest
        remaining prompt first under the fcfs policy, unless `prefill_order="arrival"`)."""
        running = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        return order_for_prefill(running, self._admission_window(plan), self._shortest_first)

    @property
    def _shortest_first(self) -> bool:
        return self.config.policy == "fcfs" and self.config.prefill_order == "shortest"

    def _schedule_prompt_chunks(
        self, plan: StepPlan, prefill_budget: PrefillBudget, prompts: list[Request]
    ) -> None:
        """Grant the rest of the budget to `prompts` (`_prompt_order`): running requests
        still computing theirs, and waiting requests being admitted.

        Admission and preemption never share a step: nobody is admitted once a request was
        preempted, and a running prompt ordered after an admission gets a chunk only from
        free blocks (short of them, it waits for the next step, and admission ends). A
        running prompt that has to preempt itself ends the step. Admission also ends with
        the first waiting request that cannot be admitted.
        """
        admitting = True
        oldest, reserved = self._oldest_prompt_reserve(plan, prompts)
        plan.token_budget -= reserved
        try:
            for request in prompts:
                if request is oldest:
                    plan.token_budget += reserved  # its share, and what the others left
                    reserved = 0
                if plan.token_budget == 0:
                    if reserved == 0:
                        break
                    continue  # the oldest prompt's share is still to come
                if request.status == RequestStatus.RUNNING:
                    if not self._schedule_prompt_chunk(request, plan, prefill_budget):
                        if request.status == RequestStatus.PREEMPTED:
                            return  # it had to preempt itself: no block is left
                        admitting = False
                elif admitting and not plan.preempted:
                    # A waiting request (a running one preempted this step leaves admission
                    # closed).
                    admitting = self._admit(request, plan, prefill_budget)
        finally:
            plan.token_budget += reserved

    def _oldest_prompt_reserve(
        self, plan: StepPlan, prompts: list[Request]
    ) -> tuple[Request | None, int]:
        """The running prompt that arrived first, and the tokens of the step's budget held for
        it while the prompts ordered before it are granted theirs: `oldest_prompt_share` of
        what the decode rows left (at most what its prompt has left). Shortest first alone
        lets a stream of short prompts hold a long one back for as long as they keep coming;
        with the share it advances every step. Only an admitted prompt is held a share: a
        waiting one might not be admitted, and the tokens held would go to nobody."""
        share = self.config.oldest_prompt_share if self._shortest_first else 0
        running = [r for r in prompts if r.status == RequestStatus.RUNNING]
        if share == 0 or not running or prompts[0] is (oldest := min(running, key=_arrival)):
            return None, 0
        wanted = self._prompt_chunk(oldest.num_tokens - oldest.num_computed_tokens,
                                    math.ceil(share * plan.token_budget))
        return oldest, wanted

    def _admission_window(self, plan: StepPlan) -> list[Request]:
        """The waiting requests this step may admit, in queue order: as many as `max_num_seqs`
        leaves room for, none in a step that preempted. Requests whose grammar is still
        compiling are passed over and keep their place, as are those whose adapter would
        exceed `max_loras` (core/lora_admission.py)."""
        room = self.config.max_num_seqs - len(self.running)
        if plan.preempted or room <= 0 or plan.token_budget == 0:
            return []
        waiting_for = (RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.WAITING_FOR_REMOTE_KVS)
        ready = (r for r in self.waiting if r.status not in waiting_for)
        if self.lora_config is not None:
            ready = admissible_by_adapter(ready, self.running, self.lora_config.max_loras)
        return list(itertools.islice(ready, room))

    def _schedule_prompt_chunk(
        self, request: Request, plan: StepPlan, prefill_budget: PrefillBudget
    ) -> bool:
        """Schedule the next chunk of a running request's prompt, as large as the budgets
        allow. False when it was granted tokens but not scheduled for want of blocks."""
        num_left = request.num_tokens - request.num_computed_tokens
        num_new_tokens = self._prompt_chunk(num_left, plan.token_budget)
        num_new_tokens = prefill_budget.grant(request.num_computed_tokens, num_new_tokens)
        if num_new_tokens == 0:
            return True
        # After an admission, free blocks only: admission and preemption never share a step.
        may_preempt = not plan.scheduled_new
        return self._schedule_running(request, num_new_tokens, plan, may_preempt=may_preempt)

    def _schedule_running(
        self,
        request: Request,
        num_new_tokens: int,
        plan: StepPlan,
        *,
        may_preempt: bool,
    ) -> bool:
        """Find blocks for `num_new_tokens` more tokens of a running request and schedule them.

        When the pool is short and `may_preempt`, running requests are preempted
        (`_choose_victim`) until the tokens fit or the request itself is the victim.
        Returns whether the request was scheduled (True too when an image it reaches cannot
        be encoded this step and nothing before the image is left to compute).
        """
        encoder_inputs = EncoderInputs()
        if request.mm_features:
            num_new_tokens, encoder_inputs = schedule_encoder_inputs(
                self.encoder_cache_manager, plan.encoder, request,
                request.num_computed_tokens, num_new_tokens,
            )
            if num_new_tokens == 0:
                return True
        while (
            new_blocks := self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens
            )
        ) is None:
            victim = self._choose_victim() if may_preempt else None
            if victim is None:
                return False
            self.running.remove(victim)
            self._preempt(victim)
            plan.add_preempted(victim)
            if victim is request:
                return False
        plan.add_running(request, num_new_tokens, [block.block_id for block in new_blocks])
        commit_encoder_inputs(self.encoder_cache_manager, plan.encoder, request, encoder_inputs)
        return True

    def _admit(self, request: Request, plan: StepPlan, prefill_budget: PrefillBudget) -> bool:
        """Admit a waiting request with the first chunk after its cached prefix.

        False when it cannot be admitted now (no room in the budgets, no free blocks, or
        the running requests' projected growth leaves no room for it: kv_lookahead.py).
        Without chunked prefill a prompt that does not fit the remaining budget is not split.
        """
        if not admission_fits(
            request,
            self.running,
            self.kv_cache_manager.num_blocks,
            self.kv_cache_manager.block_size,
            self.config.max_model_len,
            self.config.admission_lookahead_tokens,
        ):
            return False  # the running requests' growth would run the pool out (kv_lookahead.py)
        loaded = self.kv_connector is not None and self.kv_connector.is_loaded(request)
        if loaded:
            hits, num_hit_tokens = [], 0  # its blocks hold its remote KV already
        else:
            hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
        # Tokens a KV connector loads into the blocks after the local hit.
        num_external_tokens, load_async = 0, False
        if self.kv_connector is not None and not loaded:
            num_external_tokens, load_async = self.kv_connector.external_tokens(
                request, num_hit_tokens
            )
        if load_async:
            return self._wait_for_remote_kvs(request, hits, num_hit_tokens, num_external_tokens)
        num_computed_tokens = request.num_computed_tokens + num_hit_tokens + num_external_tokens
        num_new_tokens = request.num_tokens - num_computed_tokens
        if not self.config.enable_chunked_prefill and num_new_tokens > plan.token_budget:
            return False
        num_new_tokens = self._prompt_chunk(num_new_tokens, plan.token_budget)
        num_new_tokens = prefill_budget.grant(num_computed_tokens, num_new_tokens)
        encoder_inputs = EncoderInputs()
        if request.mm_features:
            num_new_tokens, encoder_inputs = schedule_encoder_inputs(
                self.encoder_cache_manager, plan.encoder, request, num_computed_tokens,
                num_new_tokens,
            )
        if num_new_tokens == 0:
            return False
        new_blocks = self.kv_cache_manager.allocate_slots(
            request,
            num_external_tokens + num_new_tokens,
            hits,
            num_hit_tokens,
            self.num_lookahead_tokens,
        )
        if new_blocks is None:
            return False
        self.waiting.remove(request)
        self.kv_cache_manager.prefix_cache_stats.record(request.num_tokens, num_hit_tokens)
        if self.kv_connector is not None:
            self.kv_connector.admitted(request, num_hit_tokens, num_external_tokens)
        request.num_computed_tokens = num_computed_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.time()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        plan.add_new(request, num_new_tokens)
        commit_encoder_inputs(self.encoder_cache_manager, plan.encoder, request, encoder_inputs)
        return True

    # ---- helpers -------------------------------------------------------------------

    def _prefill_budget(self) -> PrefillBudget:
        """This step's limit on prompt tokens: none, unless a target step time sets one."""
        target_ms = self.config.target_step_ms
        if target_ms is None or self.step_cost_model is None or not self.step_cost_model.is_ready:
            return PrefillBudget()
        decode_shape = StepShape()
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens == 1:
                num_drafts = self._num_drafts(request, self.config.max_num_batched_tokens)
                decode_shape.add(request.num_computed_tokens, 1 + num_drafts, decode=True)
        return TargetStepBudget(
            self.step_cost_model,
            target_ms,
            decode_shape,
            self.min_prefill_tokens,
            self.config.max_num_batched_tokens,
            chunked=self.config.enable_chunked_prefill,
        )

    def _prompt_chunk(self, num_prompt_tokens_left: int, token_budget: int) -> int:
        """How many of a prompt's remaining tokens a step may compute before its prefill
        budget: what `token_budget` leaves, at most `long_prefill_token_threshold` while
        another request runs or waits (a request alone delays nobody: it takes the budget)."""
        num_new_tokens = min(num_prompt_tokens_left, token_budget)
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0 and len(self.running) + len(self.waiting) > 1:
            num_new_tokens = min(num_new_tokens, threshold)
        return num_new_tokens

    def _target_leaves_waiting(self, plan: StepPlan, prompts: list[Request]) -> bool:
        """Whether the target step time would leave a waiting request of `prompts` without a
        token: the prompts granted before it spend the target. A dry run of the grants on a
        budget of its own, each waiting request from the tokens it has computed (its cached
        prefix is not looked up here)."""
        if all(r.status == RequestStatus.RUNNING for r in prompts):
            return False
        probe = self._prefill_budget()
        left = plan.token_budget
        for request in prompts:
            wanted = self._prompt_chunk(request.num_tokens - request.num_computed_tokens, left)
            granted = probe.grant(request.num_computed_tokens, wanted) if wanted > 0 else 0
            if granted == 0 and request.status != RequestStatus.RUNNING:
                return True
            left -= granted
        return False

    def _choose_victim(self) -> Request | None:
        """The request to preempt: the lowest-priority (or newest) running request; None
        while it is in a step under way (its output is still to come): the request that
        needs the blocks waits for that step instead."""
        if self.config.policy == "priority":
            victim = max(self.running, key=Request.sort_key)
        else:
            victim = self.running[-1]
        return None if victim.request_id in self.num_steps_under_way else victim

    def _sampled_tokens_of_step(self, request: Request, num_new_tokens: int) -> list[int]:
        """Under pipeline parallelism, the sampled tokens among the positions a running
        request computes this step (a decode row: its last token)."""
        if not self.pipeline_parallel:
            return []
        end = request.num_computed_tokens + num_new_tokens
        return request.all_token_ids[max(request.num_computed_tokens, request.num_prompt_tokens) : end]

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def _wait_for_remote_kvs(
        self, request: Request, hits: list, num_hit_tokens: int, num_external_tokens: int
    ) -> bool:
        """Give a request blocks for the KV a peer sends and let it wait for them
        (WAITING_FOR_REMOTE_KVS) without holding back the step; admission goes on."""
        assert self.kv_connector is not None
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, num_external_tokens, hits, num_hit_tokens, delay_cache_blocks=True
        )
        if new_blocks is None:
            return False
        self.kv_cache_manager.prefix_cache_stats.record(request.num_tokens, num_hit_tokens)
        self.kv_connector.after_alloc(request, num_hit_tokens, num_external_tokens)
        self.kv_connector.wait_for_remote_kvs(request, num_hit_tokens + num_external_tokens)
        return True

    def _fail_remote_loads(self, request_ids: set[str]) -> list[EngineCoreOutput]:
        """Requests whose KV never arrived end with "abort" (the P/D proxy reports it)."""
        self.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)
        return [
            EngineCoreOutput(request_id, [], finish_reason="abort") for request_id in request_ids
        ]

    def _recompute_failed_loads(self, request_ids: set[str]) -> None:
        """A request whose external KV did not load computed on wrong KV this step: its
        blocks leave the prefix cache and it starts over (its sampled token is dropped)."""
        assert self.kv_connector is not None
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            self.kv_connector.forget_blocks(request)
            self.running.remove(request)
            self._preempt(request)
            request.num_cached_tokens = -1

    def _free_request(self, request: Request) -> dict | None:
        """Release a finished request's blocks (unless a KV connector still copies them);
        returns the connector's `kv_transfer_params` for its last output."""
        hold, kv_transfer_params = False, None
        if self.kv_connector is not None:
            hold, kv_transfer_params = self.kv_connector.finished(request)
        if not hold:
            self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        return kv_transfer_params

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            eos_token_id=request.eos_token_id,
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
            mm_features=request.mm_features,
        )


def _arrival(request: Request) -> float:
    return request.arrival_time


def _first_positions(logprobs: LogprobsLists, count: int) -> LogprobsLists:
    return LogprobsLists(
        logprobs.token_ids[:count], logprobs.logprobs[:count], logprobs.ranks[:count]
    )
