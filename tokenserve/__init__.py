"""tokenserve: an LLM inference and serving engine with a paged, prefix-cached KV cache."""

from tokenserve.engine.engine_args import EngineArgs
from tokenserve.entrypoints.llm import LLM
from tokenserve.lora.request import LoRARequest
from tokenserve.outputs import (
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from tokenserve.pooling_params import PoolingParams
from tokenserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from tokenserve.version import __version__

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "PoolingParams",
    "PoolingRequestOutput",
    "EmbeddingRequestOutput",
    "ClassificationRequestOutput",
    "ScoringRequestOutput",
    "EngineArgs",
    "LoRARequest",
    "__version__",
]
