"""`n > 1`: one user request fanned out into n engine-core requests, merged back.

The children share the prompt token ids and are added to the engine core together, so
they are admitted in the same step: the first child registers the prompt's full blocks
in the prefix cache as it is allocated and the others reuse them, so the prompt is
computed once. Each child samples on its own; a seeded request gives child i the seed
`seed + i`, so the samples differ but the whole request stays reproducible. Only child 0
computes prompt logprobs (they are the same for every child).

Both the in-process LLMEngine and an async server use this through the Processor
(`fan_out`) and the OutputProcessor (which owns one ParentRequest per such request).
"""

from __future__ import annotations

import dataclasses

from tokenserve.core.request import Request
from tokenserve.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput
from tokenserve.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


def child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    return dataclasses.replace(
        params,
        n=1,
        seed=None if params.seed is None else params.seed + index,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
    )


def fan_out(request: Request) -> list[Request]:
    """The engine-core requests for a processed request: itself, or its n children."""
    params = request.sampling_params
    if params.n == 1:
        return [request]
    children = []
    for index in range(params.n):
        child_params = child_sampling_params(params, index)
        children.append(
            Request(
                request_id=child_request_id(request.request_id, index),
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=child_params,
                eos_token_id=request.eos_token_id,
                arrival_time=request.arrival_time,
                priority=request.priority,
                cache_salt=request.cache_salt,
                skip_prefix_cache=child_params.prompt_logprobs is not None,
                lora_request=request.lora_request,
            )
        )
    return children


class ParentRequest:
    """Merges the children's outputs into the parent's RequestOutputs.

    Streaming kinds (CUMULATIVE, DELTA) pass each child's output on as it comes, with
    its `index`; FINAL_ONLY waits for every child and returns them all, in index order.
    The parent is finished once every child is.
    """

    def __init__(self, request_id: str, params: SamplingParams, metrics: RequestMetrics) -> None:
        self.request_id = request_id
        self.n = params.n
        self.output_kind = params.output_kind
        self.child_ids = [child_request_id(request_id, index) for index in range(self.n)]
        self.metrics = metrics
        self.finished_outputs: dict[int, CompletionOutput] = {}
        self.prompt_logprobs: PromptLogprobs | None = None
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return len(self.finished_outputs) == self.n

    def merge(self, index: int, child_output: RequestOutput) -> RequestOutput | None:
        completion = child_output.outputs[0]
        completion.index = index
        self.num_cached_tokens = max(self.num_cached_tokens, child_output.num_cached_tokens)
        if child_output.prompt_logprobs is not None:
            self.prompt_logprobs = child_output.prompt_logprobs
        if completion.finished:
            self.finished_outputs[index] = completion
        if child_output.metrics is not None:
            _merge_metrics(self.metrics, child_output.metrics, self.finished)
        if self.output_kind == RequestOutputKind.FINAL_ONLY:
            if not self.finished:
                return None
            outputs = [self.finished_outputs[i] for i in range(self.n)]
            prompt_logprobs = self.prompt_logprobs
        else:
            outputs = [completion]
            prompt_logprobs = child_output.prompt_logprobs
        return RequestOutput(
            request_id=self.request_id,
            prompt=child_output.prompt,
            prompt_token_ids=child_output.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
        )


def _merge_metrics(parent: RequestMetrics, child: RequestMetrics, finished: bool) -> None:
    if child.first_token_time is not None and (
        parent.first_token_time is None or child.first_token_time < parent.first_token_time
    ):
        parent.first_token_time = child.first_token_time
    parent.last_token_time = child.last_token_time
    if finished:
        parent.finished_time = child.finished_time
