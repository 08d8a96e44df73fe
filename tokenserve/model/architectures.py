"""Which model class serves which architecture (the tables, imported by name, so that
resolving a configuration imports neither model code nor torch: the API process resolves one
too). A class is imported when a model is built, as vLLM's registry does (model/registry.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_MODELS = "tokenserve.model."
MODEL_CLASSES: dict[str, str] = {
    "LlamaForCausalLM": _MODELS + "llama:LlamaForCausalLM",
    "MistralForCausalLM": _MODELS + "llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": _MODELS + "llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": _MODELS + "qwen3:Qwen3ForCausalLM",
    # vision-language models: `embed_multimodal` runs an image's encoder (docs/MULTIMODAL.md)
    "LlavaForConditionalGeneration": _MODELS + "llava:LlavaForConditionalGeneration",
    "Idefics3ForConditionalGeneration": _MODELS + "idefics3:Idefics3ForConditionalGeneration",
}

# The pooling runner's classes (vLLM's `--runner pooling`): a causal LM is pooled without its
# LM head; base models and classifiers are pooling models only.
_POOLING = _MODELS + "decoder_pooling:"
POOLING_MODEL_CLASSES: dict[str, str] = {
    "LlamaForCausalLM": _POOLING + "LlamaForEmbedding",
    "MistralForCausalLM": _POOLING + "LlamaForEmbedding",
    "Qwen2ForCausalLM": _POOLING + "LlamaForEmbedding",
    "Qwen3ForCausalLM": _POOLING + "Qwen3ForEmbedding",
    "LlamaModel": _POOLING + "LlamaForEmbedding",
    "MistralModel": _POOLING + "LlamaForEmbedding",
    "Qwen2Model": _POOLING + "LlamaForEmbedding",
    "Qwen3Model": _POOLING + "Qwen3ForEmbedding",
    "LlamaForSequenceClassification": _POOLING + "LlamaForSequenceClassification",
    "MistralForSequenceClassification": _POOLING + "LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification": _POOLING + "LlamaForSequenceClassification",
    "Qwen3ForSequenceClassification": _POOLING + "Qwen3ForSequenceClassification",
    "BertModel": _MODELS + "bert:BertModel",
    "BertForSequenceClassification": _MODELS + "bert:BertForSequenceClassification",
}


def check_architecture(architecture: str, runner: str) -> None:
    """ValueError unless a class serves `architecture` under `runner` ("generate" or
    "pooling"); imports nothing."""
    classes = POOLING_MODEL_CLASSES if runner == "pooling" else MODEL_CLASSES
    if architecture in classes:
        return
    other = MODEL_CLASSES if runner == "pooling" else POOLING_MODEL_CLASSES
    hint = ""
    if architecture in other:
        hint = " (it runs with runner='generate')" if runner == "pooling" else (
            " (it is a pooling model: run it with runner='pooling')"
        )
    raise ValueError(
        f"Architecture {architecture!r} is not supported by the {runner!r} runner{hint}; "
        f"supported: {', '.join(classes)}."
    )


def model_class_for(architecture: str, runner: str) -> type[torch.nn.Module]:
    """The class serving `architecture` under `runner` ("generate" or "pooling"), imported."""
    check_architecture(architecture, runner)
    classes = POOLING_MODEL_CLASSES if runner == "pooling" else MODEL_CLASSES
    module, name = classes[architecture].split(":")
    return getattr(importlib.import_module(module), name)


def resolve_runner(architecture: str, runner: str) -> str:
    """vLLM's runner "auto": pooling for an architecture only a pooling model has."""
    if runner != "auto":
        return runner
    if architecture in POOLING_MODEL_CLASSES and architecture not in MODEL_CLASSES:
        return "pooling"
    return "generate"
