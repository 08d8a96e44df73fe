"""What crosses the wire between the API process and the engine-core process.

msgspec structs, encoded as msgpack. The engine core receives requests as token ids
(never text) and answers with batches of EngineCoreOutputs plus its scheduler stats.
Each message travels as two ZMQ frames: its kind, then its msgpack payload.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from tokenserve.core.request import Request
from tokenserve.core.scheduler import EngineCoreOutput, SchedulerStats
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

    @classmethod
    def from_request(cls, request: Request) -> EngineCoreRequest:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            skip_prefix_cache=request.skip_prefix_cache,
        )

    def to_request(self) -> Request:
        return Request(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params,
            eos_token_id=self.eos_token_id,
            arrival_time=self.arrival_time,
            priority=self.priority,
            cache_salt=self.cache_salt,
            skip_prefix_cache=self.skip_prefix_cache,
        )


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """One message from the engine core: a step's outputs, its stats, or its dying words."""

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    # The scheduler's state after the step (or after an idle abort): gauges and counters.
    scheduler_stats: SchedulerStats | None = None
    # Tokens the step computed (prompt chunks and decodes together); 0 for a stats-only message.
    num_scheduled_tokens: int = 0
    # Requests scheduled for the first time in this step → when the step started (time.time()).
    first_scheduled_times: dict[str, float] = {}
    # Set when the engine core failed and is about to exit.
    engine_error: str | None = None


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
