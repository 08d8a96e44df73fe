"""A request as the engine core sees it: token ids, sampling params and progress.

Progress is one number, `num_computed_tokens`, chasing `num_tokens` (prompt plus the
output so far). The scheduler's only rule is to bring the first up to the second.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenserve.lora.request import LoRARequest
from tokenserve.messages.engine_core import EngineCoreRequest
from tokenserve.messages.multimodal import MultiModalFeature
from tokenserve.pooling_params import PoolingParams
from tokenserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenserve.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Waiting, and not admitted before its structured-output grammar is compiled.
    WAITING_FOR_GRAMMAR = enum.auto()
    # Waiting, its blocks allocated, while a KV connector loads its KV asynchronously.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    cache_salt: str | None = None
    # Requests that need every position's logits (prompt logprobs) must compute them all.
    skip_prefix_cache: bool = False
    # A pooling request: finishes when its prompt is computed, with the pooled result.
    pooling_params: PoolingParams | None = None
    # The adapter it runs with (LoRA): a block-hash extra key, so adapters share no KV.
    lora_request: LoRARequest | None = None
    # Its images: placeholder spans, hashes (block-hash extra keys), encoder inputs.
    mm_features: list[MultiModalFeature] | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache the first time the request was scheduled.
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # Draft tokens proposed after the last token (speculative decoding), verified in the
    # request's next step; never part of all_token_ids, block hashes or stop checks.
    spec_token_ids: list[int] = field(default_factory=list)
    # Hashes of the request's full blocks, extended as tokens are appended.
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    # The grammar state of a request with structured outputs (set by the engine core).
    structured_output_request: StructuredOutputRequest | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        # KV connectors (P/D, vLLM's field): where its KV comes from or is to go.
        extra_args = self.sampling_params.extra_args or {}
        self.kv_transfer_params: dict[str, Any] | None = extra_args.get("kv_transfer_params")

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> Request:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            skip_prefix_cache=request.skip_prefix_cache,
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
            mm_features=request.mm_features,
        )

    def to_engine_core_request(self) -> EngineCoreRequest:
        """The wire form of a request not yet added (the API process sends it)."""
        return EngineCoreRequest(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            sampling_params=self.sampling_params,
            eos_token_id=self.eos_token_id,
            arrival_time=self.arrival_time,
            priority=self.priority,
            cache_salt=self.cache_salt,
            skip_prefix_cache=self.skip_prefix_cache,
            pooling_params=self.pooling_params,
            lora_request=self.lora_request,
            mm_features=self.mm_features,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def wait_for_grammar(self) -> None:
        """Not admitted until its structured-output grammar is compiled (the manager's call)."""
        self.status = RequestStatus.WAITING_FOR_GRAMMAR

    def grammar_ready(self) -> None:
        self.status = RequestStatus.WAITING

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def sort_key(self) -> tuple[int, float]:
        """Order for the priority policy: a lower value is served first."""
        return (self.priority, self.arrival_time)
