"""What the engine returns to its users: RequestOutput and CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class Logprob:
    """One token's log probability, its rank in the vocabulary (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id → Logprob; the chosen token first, then the top-k alternatives.
LogprobsDict = dict[int, Logprob]
SampleLogprobs = list[LogprobsDict]
# The first prompt position has no logprob (nothing precedes it): None, as in vLLM.
PromptLogprobs = list[LogprobsDict | None]


@dataclass
class CompletionOutput:
    """One sample of a request; `index` is its place among the request's `n` samples."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None  # None unless SamplingParams.logprobs is set
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None  # None unless SamplingParams.prompt_logprobs
    # Prompt tokens served from the prefix cache (for n > 1: the most any sample was served).
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
