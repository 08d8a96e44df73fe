"""tokenserve: an LLM inference and serving engine with a paged, prefix-cached KV cache.

The public names are imported on first use (PEP 562), so that `tokenserve serve` and the
engine-core process import only what they run, not the offline `LLM` with torch and
transformers behind it (docs/STARTUP.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tokenserve.version import __version__

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "tokenserve.entrypoints.llm",
    "SamplingParams": "tokenserve.sampling_params",
    "StructuredOutputsParams": "tokenserve.sampling_params",
    "RequestOutputKind": "tokenserve.sampling_params",
    "RequestOutput": "tokenserve.outputs",
    "CompletionOutput": "tokenserve.outputs",
    "Logprob": "tokenserve.outputs",
    "PoolingParams": "tokenserve.pooling_params",
    "PoolingRequestOutput": "tokenserve.outputs",
    "EmbeddingRequestOutput": "tokenserve.outputs",
    "ClassificationRequestOutput": "tokenserve.outputs",
    "ScoringRequestOutput": "tokenserve.outputs",
    "EngineArgs": "tokenserve.engine.engine_args",
    "LoRARequest": "tokenserve.lora.request",
}

__all__ = [
    "LLM",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "LoRARequest",
    "Logprob",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "__version__",
]

if TYPE_CHECKING:
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
    from tokenserve.sampling_params import (
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
