"""What the workers answer the engine core: the new tokens of each request sampled in a step."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenserve.messages.engine_core import LogprobsLists


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
