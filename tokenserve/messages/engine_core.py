"""What crosses the wire between the API process and the engine-core process.

msgspec structs, encoded as msgpack. The engine core receives requests as token ids
(never text) and answers with batches of EngineCoreOutputs plus its scheduler stats.
Each message to the engine core travels as two ZMQ frames: its kind, then its msgpack
payload. The engine core's `Request` converts to and from `EngineCoreRequest`
(core/request.py).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from tokenserve.lora.request import LoRARequest
from tokenserve.messages.multimodal import MultiModalFeature
from tokenserve.pooling_params import PoolingParams
from tokenserve.sampling_params import SamplingParams


class EngineCoreRequestType(bytes, enum.Enum):
    """The first frame of every message sent to the engine core."""

    ADD = b"\x00"
    ABORT = b"\x01"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A validated, tokenized request: everything the core needs to build its Request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    skip_prefix_cache: bool = False
    # A pooling request (its prompt pooled, nothing sampled); None for a generate request.
    pooling_params: PoolingParams | None = None
    # The adapter the request runs with (LoRA); None: the base model.
    lora_request: LoRARequest | None = None
    # The prompt's images, in prompt order (messages/multimodal.py); None: text only.
    mm_features: list[MultiModalFeature] | None = None


class LogprobsLists(msgspec.Struct, array_like=True):
    """Per position: token ids [chosen, top-1, ..., top-k], their logprobs, the chosen rank.

    The plain-list form of a step's logprobs (sample/logprobs.py), cut per request."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # 1 = the most likely token of the vocabulary

    def __len__(self) -> int:
        return len(self.ranks)

    def extend(self, other: LogprobsLists) -> None:
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.ranks.extend(other.ranks)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
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
    # A pooling request's result (embedding, class probabilities or [score]), when it finishes.
    pooling_output: list[float] | None = None
    # With a KV connector, on the finished output: what a decode instance needs to load
    # this request's KV (P/D), vLLM's `kv_transfer_params`.
    kv_transfer_params: dict[str, Any] | None = None


class SpecDecodingStats(msgspec.Struct, array_like=True):
    """Speculative decoding since the engine started: drafts verified (one per request and
    step), their tokens, the accepted ones, and the accepted ones per draft position."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if len(self.num_accepted_tokens_per_pos) < self.num_spec_tokens:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )


class RequestSnapshot(msgspec.Struct, array_like=True):
    """One unfinished request as the dashboard shows it."""

    request_id: str
    status: str  # "running", "waiting" or "preempted"
    num_prompt_tokens: int
    num_computed_tokens: int
    num_tokens: int
    num_preemptions: int


# DashboardSnapshot.block_owners codes beside a request's index in `requests`.
BLOCK_FREE = -1  # free, holding no cached prefix
BLOCK_CACHED = -2  # free, but its prefix is cached: reusable until evicted
BLOCK_SHARED = -3  # in use by several requests (a shared prefix)


class DashboardSnapshot(msgspec.Struct, array_like=True):
    """The KV block map and the queues, sent at a bounded rate for /dashboard."""

    # Per block: the index in `requests` of the request holding it, or a BLOCK_* code.
    block_owners: list[int]
    # Running requests first (in running order), then the waiting queue (in its order).
    requests: list[RequestSnapshot]


class KVConnectorStats(msgspec.Struct, array_like=True):
    """A KV connector's counters (cumulative): prompt tokens looked up in and found in the
    external store, and the bytes and seconds the workers loaded and saved."""

    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    bytes_loaded: int = 0
    seconds_loaded: float = 0.0
    bytes_saved: int = 0
    seconds_saved: float = 0.0
    # Stored blocks found torn or corrupt (ignored, never served).
    corrupt_blocks: int = 0
    # Requests whose KV load failed (recomputed or ended).
    failed_loads: int = 0

    def copy(self) -> KVConnectorStats:
        return msgspec.structs.replace(self)


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """The scheduler's state after a step (or an idle abort): gauges and counters."""

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
    # Speculative decoding's counters (cumulative); None when it is off.
    spec_decoding_stats: SpecDecodingStats | None = None
    # The KV connector's counters (cumulative); None without one.
    kv_connector_stats: KVConnectorStats | None = None


    # The KV block map and queues, at most every few hundred ms (for /dashboard).
    dashboard: DashboardSnapshot | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """One message from the engine core: a step's outputs, its stats, or its dying words."""

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    # The scheduler's state after the step (or after an idle abort): gauges and counters.
    scheduler_stats: SchedulerStats | None = None
    # Tokens the step computed (prompt chunks and decodes together); 0 for a stats-only message.
    num_scheduled_tokens: int = 0
    # Of those, decode rows' tokens (rows of one token after the prompt); the rest is prefill.
    num_decode_tokens: int = 0
    # The query-key pairs the step's attention covered (its shape, with the token count).
    num_attention_pairs: int = 0
    # Requests scheduled for the first time in this step → when the step started (time.time()).
    first_scheduled_times: dict[str, float] = {}
    # Set when the engine core failed and is about to exit.
    engine_error: str | None = None
    # The data-parallel engine that sent it (set by the API process as it receives it).
    engine_index: int = 0


def _encode_hook(obj: Any) -> Any:
    # Sets (e.g. in sampling params) travel as lists; the decoder's type hints restore them.
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    raise NotImplementedError(f"Cannot send a {type(obj).__name__} to or from the engine core.")


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_encode_hook)


def make_request_decoder() -> msgspec.msgpack.Decoder[EngineCoreRequest]:
    return msgspec.msgpack.Decoder(EngineCoreRequest)


def make_abort_decoder() -> msgspec.msgpack.Decoder[list[str]]:
    return msgspec.msgpack.Decoder(list[str])


def make_outputs_decoder() -> msgspec.msgpack.Decoder[EngineCoreOutputs]:
    return msgspec.msgpack.Decoder(EngineCoreOutputs)
