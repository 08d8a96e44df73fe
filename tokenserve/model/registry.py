"""Which model class serves which architecture, and a model built, loaded and made ready.

The tables name the classes ("module:Class"); a class is imported when a model is built (as
vLLM's registry does), so resolving a configuration imports no model code.
"""

from __future__ import annotations

import importlib
import logging

import torch

from tokenserve.attention.backend import AttentionBackend
from tokenserve.config import KernelConfig, ModelConfig
from tokenserve.distributed.parallel_state import ModelParallel
from tokenserve.model.layers.quantization import get_linear_method
from tokenserve.model.load_threads import load_threads
from tokenserve.model.loader import iterate_model_weights
from tokenserve.model.precision import activation_dtype
from tokenserve.model.weight_cache import WeightDtypes

logger = logging.getLogger(__name__)

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


def build_model(
    model_config: ModelConfig,
    attention: AttentionBackend,
    kernel_config: KernelConfig | None = None,
    parallel: ModelParallel | None = None,
) -> torch.nn.Module:
    """The model with its weights allocated, not loaded; its linear layers' quantization
    method chosen from the model's format. `parallel`: this rank's share of it (the llama
    family; several ranks)."""
    model_class = model_class_for(model_config.architecture, model_config.runner)
    kernel_config = kernel_config or KernelConfig()
    extra = {"parallel": parallel} if parallel is not None and parallel.world_size > 1 else {}
    return model_class(
        model_config.hf_config,
        # A bfloat16 model's products are bf16, its activations float32 (model/precision.py).
        dtype=activation_dtype(model_config.dtype),
        attention=attention,
        max_position=model_config.max_model_len,
        linear_method=get_linear_method(model_config.format, model_config.dtype, kernel_config),
        kernel_config=kernel_config,
        **extra,
    )


def process_weights_after_loading(model: torch.nn.Module) -> None:
    """Each layer's loaded weights into the form its quantization method reads (packed for
    oneDNN, GGUF blocks joined); once, after loading, on the model's device."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def get_model(
    model_config: ModelConfig,
    attention: AttentionBackend,
    kernel_config: KernelConfig,
    device: torch.device,
    parallel: ModelParallel | None = None,
) -> torch.nn.Module:
    """The model built, its weights loaded (GGUF blocks too, for a method that keeps them),
    moved to `device` and processed: ready to run."""
    torch.manual_seed(model_config.seed)
    model = build_model(model_config, attention, kernel_config, parallel)
    with load_threads(model):  # a small model loads on one thread (load_threads.py)
        # A GGUF model's cached weights come in its parameters' dtypes (no cast at load).
        model.load_weights(iterate_model_weights(model_config.files, WeightDtypes.of(model)))
        model = model.to(device).eval()
        process_weights_after_loading(model)
    logger.info("Linear layers: %s.", model.linear_method)
    return model
