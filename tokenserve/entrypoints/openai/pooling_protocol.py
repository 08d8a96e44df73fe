"""Request and response bodies of the pooling routes, in vLLM's shapes: /v1/embeddings
(OpenAI's), /score, /rerank (Jina / Cohere), /classify. Requests turn into PoolingParams."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from tokenserve.entrypoints.openai.protocol import (
    Int64,
    NonNegativeInt64,
    OpenAIModel,
    RequestBody,
    UsageInfo,
    now_seconds,
    random_id,
)
from tokenserve.pooling_params import PoolingParams

TokenIds = list[NonNegativeInt64]
# One text, several, one prompt as token ids, or several such prompts.
PoolingInput = str | list[str] | TokenIds | list[TokenIds]
TruncatePromptTokens = Annotated[int, Field(ge=-1, le=2**31)]


class PoolingRequestBase(RequestBody):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    priority: Int64 = 0
    cache_salt: str | None = None

    def to_pooling_params(self, task: str) -> PoolingParams:
        return PoolingParams(
            task=task,
            truncate_prompt_tokens=self.truncate_prompt_tokens or None,
            **self._task_fields(),
        )

    def _task_fields(self) -> dict:
        return {}


class EmbeddingRequest(PoolingRequestBase):
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=2**31)] | None = None
    normalize: bool | None = None

    def _task_fields(self) -> dict:
        return {"dimensions": self.dimensions, "normalize": self.normalize}


class EmbeddingResponseData(OpenAIModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_seconds)
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class ScoreRequest(PoolingRequestBase):
    text_1: str | list[str]
    text_2: str | list[str]
    use_activation: bool | None = None

    def _task_fields(self) -> dict:
        return {"use_activation": self.use_activation}


class ScoreResponseData(OpenAIModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_seconds)
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankRequest(PoolingRequestBase):
    query: str
    documents: list[str]
    # 0: every document.
    top_n: Annotated[int, Field(ge=0, le=2**31)] = 0
    use_activation: bool | None = None

    def _task_fields(self) -> dict:
        return {"use_activation": self.use_activation}


class RerankDocument(OpenAIModel):
    text: str


class RerankResult(OpenAIModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(OpenAIModel):
    total_tokens: int


class RerankResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassificationRequest(PoolingRequestBase):
    input: PoolingInput
    use_activation: bool | None = None

    def _task_fields(self) -> dict:
        return {"use_activation": self.use_activation}


class ClassificationData(OpenAIModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("classify"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_seconds)
    model: str
    data: list[ClassificationData]
    usage: UsageInfo
