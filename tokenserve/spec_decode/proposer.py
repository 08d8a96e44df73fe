"""What the model runner sees of a proposer: the `Proposer` interface, the n-gram one behind
it, and the rules both share (how many drafts can count, decode-row splitting).

After each step's sampling the runner calls `propose`; its drafts reach the scheduler in
`ModelRunnerOutput.draft_token_ids` (vLLM V1's shape). `draft_probs` gives the
distribution a request's scheduled drafts were drawn from, for the rejection sampler
(None: point masses).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from tokenserve.config import EngineConfig
from tokenserve.messages.scheduler_output import SchedulerOutput
from tokenserve.sampling_params import SamplingParams
from tokenserve.spec_decode.ngram_proposer import NgramProposer


class ProposerRequest(Protocol):
    """What a proposer reads of the runner's per-request state (worker/request_state.py)."""

    request_id: str
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # at the start of this step
    num_tokens: int
    num_prompt_tokens: int

    @property
    def token_ids(self) -> np.ndarray: ...


class Proposer(Protocol):
    # The proposer's own KV caches (a draft model's; none for prompt lookup), laid out as
    # the engine's attention backend lays them out.
    kv_caches: list[torch.Tensor]

    def load_model(self) -> None: ...

    def initialize_kv_cache(self) -> None: ...

    def propose(
        self,
        scheduler_output: SchedulerOutput,
        requests: dict[str, ProposerRequest],
        sampled_ids: list[str],
    ) -> dict[str, list[int]]:
        """Drafts for the requests sampled this step (after their new tokens)."""
        ...

    def draft_probs(self, request_id: str, drafts: list[int]) -> torch.Tensor | None: ...


class NgramRunnerProposer:
    """Prompt lookup for each sampled request, capped by what it may still generate."""

    def __init__(self, config: EngineConfig) -> None:
        assert config.speculative_config is not None
        self.spec = config.speculative_config
        self.ngram = NgramProposer(self.spec)
        self.max_model_len = config.model_config.max_model_len
        self.kv_caches: list[torch.Tensor] = []

    def load_model(self) -> None:
        """No model."""

    def initialize_kv_cache(self) -> None:
        """No cache."""

    def propose(
        self,
        scheduler_output: SchedulerOutput,
        requests: dict[str, ProposerRequest],
        sampled_ids: list[str],
    ) -> dict[str, list[int]]:
        if not self.spec.speculates(len(requests)):
            return {}
        drafts = {}
        for request_id in sampled_ids:
            state = requests[request_id]
            room = draft_room(state, self.spec.num_speculative_tokens, self.max_model_len)
            proposal = self.ngram.propose(state.token_ids, room)
            if proposal:
                drafts[request_id] = proposal
        return drafts

    def draft_probs(self, request_id: str, drafts: list[int]) -> torch.Tensor | None:
        return None


def draft_room(state: ProposerRequest, k: int, max_model_len: int) -> int:
    """How many drafts could count: none at or past max_model_len - 1 (the request ends
    there) or past max_tokens (the token after the last accepted draft is the last one)."""
    room = min(k, max_model_len - 1 - state.num_tokens)
    max_tokens = state.sampling_params.max_tokens
    if max_tokens is not None:
        room = min(room, max_tokens - (state.num_tokens - state.num_prompt_tokens) - 1)
    return max(0, room)


def attention_rows(start: int, end: int, split: bool) -> list[tuple[int, int]]:
    """(query length, context length) of the attention rows for positions [start, end) of
    one request: one row, or with `split` one decode row per token. A run of drafts split
    so attends with the decode kernels (fused on CPU) and gives the very results of decoding
    its tokens one at a time: every row's K/V is written before any row attends."""
    if not split:
        return [(end - start, end)]
    return [(1, position + 1) for position in range(start, end)]
