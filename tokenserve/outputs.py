"""What the engine returns to its users: RequestOutput and CompletionOutput; for pooling
requests PoolingRequestOutput and its embedding / classification / scoring forms."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    # With a KV connector (P/D, vLLM's field): where a decode instance finds this KV.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class PoolingOutput:
    """A pooling request's result as the model gives it (vLLM's `PoolingOutput.data`)."""

    data: list[float]


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """One pooling request, finished: `outputs` is a PoolingOutput, or the task's own output
    in the typed subclasses below (vLLM's shapes)."""

    request_id: str
    outputs: PoolingOutput | EmbeddingOutput | ClassificationOutput | ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt: str | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        assert isinstance(output.outputs, PoolingOutput)
        return cls(**{**vars(output), "outputs": EmbeddingOutput(output.outputs.data)})


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ClassificationRequestOutput:
        assert isinstance(output.outputs, PoolingOutput)
        return cls(**{**vars(output), "outputs": ClassificationOutput(output.outputs.data)})


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ScoringRequestOutput:
        assert isinstance(output.outputs, PoolingOutput)
        return cls(**{**vars(output), "outputs": ScoringOutput(output.outputs.data[0])})
