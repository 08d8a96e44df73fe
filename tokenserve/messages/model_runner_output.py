"""What the workers answer the engine core: the new tokens of each request sampled in a step."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenserve.messages.engine_core import LogprobsLists


@dataclass
class KVConnectorOutput:
    """What a KV connector's worker side reports after a step."""

    # Requests whose blocks the workers finished sending (the scheduler may free them now).
    finished_sending: set[str] = field(default_factory=set)
    # Requests whose asynchronous load finished (they may be scheduled now).
    finished_recving: set[str] = field(default_factory=set)
    # Requests whose load failed or whose loaded KV did not verify: never computed on.
    failed_recving: set[str] = field(default_factory=set)
    # This step's copies.
    bytes_loaded: int = 0
    seconds_loaded: float = 0.0
    bytes_saved: int = 0
    seconds_saved: float = 0.0
    corrupt_blocks: int = 0


@dataclass
class ModelRunnerOutput:
    # The requests that sampled this step, in batch order.
    req_ids: list[str] = field(default_factory=list)
    # Per request of `req_ids`, its new tokens in order: one, or with draft tokens to verify
    # (speculative decoding) the accepted drafts and one token after them.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Only for requests that asked: one position per new token, and (once, in the step that
    # samples the first token) the whole prompt's.
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Pooling requests whose prompt this step completed → their pooled result.
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # Speculative decoding: the proposer's drafts for the requests sampled this step, for
    # the scheduler's `update_draft_token_ids`.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # With a KV connector: its copies finished this step and its counters.
    kv_connector_output: KVConnectorOutput | None = None
