"""Engine-core outputs (token ids) → RequestOutputs (text, logprobs, finish reasons, metrics).

The engine core never detokenizes; this is where token ids become text, incrementally
(engine/detokenizer.py), where stop strings end requests (reported in `reqs_to_abort`
so the caller drops them from the engine core; the user sees finish_reason "stop"), and
where the n children of a parallel-sampling request merge back (engine/parallel_sampling.py).

Usage, the same from LLMEngine and from an async server:
    prompt_text, request = processor.process(...)
    output_processor.add_request(request_id, prompt_text, request.prompt_token_ids,
                                 request.sampling_params, request.arrival_time)
    for core_request in parallel_sampling.fan_out(request):
        engine_core.add_request(core_request)
    ... output_processor.process_outputs(core_outputs) → request_outputs, reqs_to_abort
    engine_core.abort_requests(output_processor.abort_requests([request_id]))
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenserve.engine.detokenizer import IncrementalDetokenizer
from tokenserve.engine.logprobs import LogprobsDecoder
from tokenserve.engine.parallel_sampling import (
    ParentRequest,
    child_sampling_params,
)
from tokenserve.messages.engine_core import EngineCoreOutput
from tokenserve.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from tokenserve.pooling_params import PoolingParams
from tokenserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class RequestState:
    """One engine-core request as the output processor follows it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer
    parent: ParentRequest | None = None
    index: int = 0  # place among the parent's n samples
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    # With a KV connector, from the finished output: where its KV went (P/D).
    kv_transfer_params: dict[str, Any] | None = None
    # DELTA: how many tokens (and logprobs) earlier outputs carried; prompt logprobs sent.
    num_sent_tokens: int = 0
    prompt_logprobs_sent: bool = False


@dataclass
class PoolingRequestState:
    """A pooling request until its one output arrives (no text, no tokens to follow)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput | PoolingRequestOutput]
    # Requests the detokenizer finished (a stop string): the engine core must drop them.
    reqs_to_abort: list[str]


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.logprobs_decoder = LogprobsDecoder(tokenizer)
        # Keyed by engine-core request id (a child's id for n > 1).
        self.request_states: dict[str, RequestState] = {}
        # n > 1 requests, keyed by the user's request id.
        self.parent_requests: dict[str, ParentRequest] = {}
        self.pooling_states: dict[str, PoolingRequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        arrival_time: float,
    ) -> None:
        if (
            request_id in self.request_states
            or request_id in self.parent_requests
            or request_id in self.pooling_states
        ):
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if isinstance(params, PoolingParams):
            self.pooling_states[request_id] = PoolingRequestState(
                request_id, prompt, prompt_token_ids, RequestMetrics(arrival_time=arrival_time)
            )
            return
        if params.n == 1:
            self.request_states[request_id] = self._new_state(
                request_id, prompt, prompt_token_ids, params, arrival_time
            )
            return
        parent = ParentRequest(request_id, params, RequestMetrics(arrival_time=arrival_time))
        for index, child_id in enumerate(parent.child_ids):
            state = self._new_state(
                child_id,
                prompt,
                prompt_token_ids,
                child_sampling_params(params, index),
                arrival_time,
            )
            state.parent, state.index = parent, index
            self.request_states[child_id] = state
        self.parent_requests[request_id] = parent

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget the requests; returns the engine-core request ids to abort (n > 1: children)."""
        core_ids = []
        for request_id in request_ids:
            parent = self.parent_requests.pop(request_id, None)
            ids = parent.child_ids if parent is not None else [request_id]
            for core_id in ids:
                self.request_states.pop(core_id, None)
                self.pooling_states.pop(core_id, None)
            core_ids.extend(ids)
        return core_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states) or bool(self.pooling_states)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        """Fold one step's engine-core outputs in; RequestOutputs as each output_kind asks."""
        now = time.time()
        request_outputs = []
        reqs_to_abort = []
        for output in outputs:
            if output.request_id in self.pooling_states:
                request_outputs.append(self._pooling_output(output, now))
                continue
            state = self.request_states.get(output.request_id)
            if state is None:
                continue
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
            state.output_token_ids.extend(output.new_token_ids)
            state.num_cached_tokens = output.num_cached_tokens
            if output.kv_transfer_params is not None:
                state.kv_transfer_params = output.kv_transfer_params
            self._add_logprobs(state, output)

            finish_reason, stop_reason = output.finish_reason, output.stop_reason
            stop_string = state.detokenizer.update(
                output.new_token_ids,
                finished=finish_reason is not None,
                stop_terminated=finish_reason == "stop",
            )
            if stop_string is not None:
                if finish_reason is None:
                    reqs_to_abort.append(output.request_id)
                finish_reason, stop_reason = "stop", stop_string

            if finish_reason is not None:
                state.metrics.finished_time = now
                del self.request_states[output.request_id]
            elif state.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            request_output = self._make_output(state, finish_reason, stop_reason)
            if state.parent is not None:
                merged = state.parent.merge(state.index, request_output)
                if state.parent.finished:
                    self.parent_requests.pop(state.parent.request_id, None)
                if merged is None:
                    continue  # FINAL_ONLY: other children still running
                request_output = merged
            request_outputs.append(request_output)
        return OutputProcessorOutput(request_outputs, reqs_to_abort)

    def _pooling_output(self, output: EngineCoreOutput, now: float) -> PoolingRequestOutput:
        state = self.pooling_states.pop(output.request_id)
        state.metrics.first_token_time = state.metrics.finished_time = now
        return PoolingRequestOutput(
            request_id=state.request_id,
            outputs=PoolingOutput(list(output.pooling_output or [])),
            prompt_token_ids=state.prompt_token_ids,
            finished=True,
            num_cached_tokens=output.num_cached_tokens,
            prompt=state.prompt,
            metrics=state.metrics,
        )

    def _new_state(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> RequestState:
        return RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            metrics=RequestMetrics(arrival_time=arrival_time),
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
        )

    def _add_logprobs(self, state: RequestState, output: EngineCoreOutput) -> None:
        if output.new_logprobs is not None and state.logprobs is not None:
            state.logprobs.extend(self.logprobs_decoder.to_dicts(output.new_logprobs))
            state.cumulative_logprob = (state.cumulative_logprob or 0.0) + sum(
                logprobs[0] for logprobs in output.new_logprobs.logprobs
            )
        if output.new_prompt_logprobs is not None:
            prompt_logprobs: PromptLogprobs = [None]
            prompt_logprobs.extend(self.logprobs_decoder.to_dicts(output.new_prompt_logprobs))
            state.prompt_logprobs = prompt_logprobs

    def _make_output(
        self, state: RequestState, finish_reason: str | None, stop_reason: int | str | None
    ) -> RequestOutput:
        finished = finish_reason is not None
        delta = state.sampling_params.output_kind == RequestOutputKind.DELTA
        text = state.detokenizer.get_next_output_text(finished, delta)
        start = state.num_sent_tokens if delta else 0
        token_ids = state.output_token_ids[start:]
        logprobs = state.logprobs[start:] if state.logprobs is not None else None
        prompt_logprobs = state.prompt_logprobs
        if delta and state.prompt_logprobs_sent:
            prompt_logprobs = None
        state.prompt_logprobs_sent = state.prompt_logprobs_sent or prompt_logprobs is not None
        state.num_sent_tokens = len(state.output_token_ids)
        completion = CompletionOutput(
            index=state.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        return RequestOutput(
            request_id=state.request_id if state.parent is None else state.parent.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
            kv_transfer_params=state.kv_transfer_params,
        )
