"""Which model class serves which architecture, and a model built, loaded and made ready."""

from __future__ import annotations

import itertools
import logging

import torch

from tokenserve.attention.backend import AttentionBackend
from tokenserve.config import KernelConfig, ModelConfig
from tokenserve.model.layers.quantization import get_linear_method
from tokenserve.model.llama import LlamaForCausalLM
from tokenserve.model.loader import iterate_quantized_weights, iterate_weights

logger = logging.getLogger(__name__)

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def build_model(
    model_config: ModelConfig,
    attention: AttentionBackend,
    kernel_config: KernelConfig | None = None,
) -> torch.nn.Module:
    """The model with its weights allocated, not loaded; its linear layers' quantization
    method chosen from the model's format."""
    model_class = MODEL_CLASSES.get(model_config.architecture)
    if model_class is None:
        raise ValueError(
            f"Architecture {model_config.architecture!r} is not supported; "
            f"supported: {', '.join(MODEL_CLASSES)}."
        )
    kernel_config = kernel_config or KernelConfig()
    return model_class(
        model_config.hf_config,
        dtype=model_config.dtype,
        attention=attention,
        max_position=model_config.max_model_len,
        linear_method=get_linear_method(model_config.format, model_config.dtype, kernel_config),
        kernel_config=kernel_config,
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
) -> torch.nn.Module:
    """The model built, its weights loaded (GGUF blocks too, for a method that keeps them),
    moved to `device` and processed: ready to run."""
    torch.manual_seed(model_config.seed)
    model = build_model(model_config, attention, kernel_config)
    files = model_config.files
    model.load_weights(itertools.chain(iterate_weights(files), iterate_quantized_weights(files)))
    model = model.to(device).eval()
    process_weights_after_loading(model)
    logger.info("Linear layers: %s.", model.linear_method)
    return model
