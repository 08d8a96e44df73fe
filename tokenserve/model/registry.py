"""Which model class serves which architecture."""

from __future__ import annotations

import torch

from tokenserve.attention.backend import AttentionBackend
from tokenserve.config import ModelConfig
from tokenserve.model.llama import LlamaForCausalLM

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def build_model(model_config: ModelConfig, attention: AttentionBackend) -> torch.nn.Module:
    model_class = MODEL_CLASSES.get(model_config.architecture)
    if model_class is None:
        raise ValueError(
            f"Architecture {model_config.architecture!r} is not supported; "
            f"supported: {', '.join(MODEL_CLASSES)}."
        )
    return model_class(
        model_config.hf_config,
        dtype=model_config.dtype,
        attention=attention,
        max_position=model_config.max_model_len,
    )
