"""LLaVA (`LlavaForConditionalGeneration`): a CLIP or SigLIP vision tower, a two-layer
projector, and a Llama / Mistral / Qwen2 language model (model/llama.py).

An image's encoder output (`embed_multimodal`) is the tower's hidden states at
`vision_feature_layer` (without CLIP's class token under the "default" strategy), projected
to the language model's width: one row per image token of its placeholder. The language
model then runs on embeddings in which those rows replace the image tokens' (the model
runner merges them: worker/encoder_runner.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers.activations import ACT2FN

from tokenserve.attention.backend import AttentionBackend, AttentionMetadata
from tokenserve.config import KernelConfig
from tokenserve.model.layers.quantization import QuantizationMethod
from tokenserve.model.llama import LlamaForCausalLM
from tokenserve.model.qwen3 import Qwen3ForCausalLM
from tokenserve.model.vision_encoder import VisionTransformer
from tokenserve.model.vision_weights import load_module_weights, split_vlm_weights


def language_model_class(text_config) -> type[LlamaForCausalLM]:
    return Qwen3ForCausalLM if text_config.model_type == "qwen3" else LlamaForCausalLM


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        layers = config.vision_feature_layer
        num_layers = len(layers) if isinstance(layers, (list, tuple)) else 1
        bias = getattr(config, "multimodal_projector_bias", True)
        vision_hidden = config.vision_config.hidden_size * num_layers
        text_hidden = config.text_config.hidden_size
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class VisionLanguageModel(nn.Module):
    """What the vision-language models share: the text side is their language model's (built
    here from `text_config`: its input embeddings, its forward over the KV cache, its
    logits); a subclass adds its vision tower (`embed_multimodal`)."""

    def __init__(
        self,
        hf_config,
        dtype: torch.dtype,
        attention: AttentionBackend,
        max_position: int,
        linear_method: QuantizationMethod,
        kernel_config: KernelConfig,
    ) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.linear_method = linear_method
        text_config = hf_config.text_config
        self.language_model = language_model_class(text_config)(
            text_config, dtype, attention, max_position, linear_method, kernel_config
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.language_model.model(input_ids, positions, kv_caches, metadata, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)


class LlavaForConditionalGeneration(VisionLanguageModel):
    def __init__(
        self,
        hf_config,
        dtype: torch.dtype,
        attention: AttentionBackend,
        max_position: int,
        linear_method: QuantizationMethod,
        kernel_config: KernelConfig,
    ) -> None:
        vision_config = hf_config.vision_config
        if vision_config.model_type not in ("clip_vision_model", "siglip_vision_model"):
            raise ValueError(
                f"LLaVA's vision tower must be CLIP or SigLIP, got {vision_config.model_type!r}."
            )
        super().__init__(
            hf_config, dtype, attention, max_position, linear_method, kernel_config
        )
        self.has_class_token = vision_config.model_type == "clip_vision_model"
        self.vision_tower = VisionTransformer(vision_config, class_token=self.has_class_token)
        self.multi_modal_projector = LlavaMultiModalProjector(hf_config)
        self.vision_tower.to(dtype)
        self.multi_modal_projector.to(dtype)
        layers = hf_config.vision_feature_layer
        layers = list(layers) if isinstance(layers, (list, tuple)) else [layers]
        total = vision_config.num_hidden_layers
        # Hidden-state indices as transformers counts them (0: the embeddings).
        self.feature_layers = [layer if layer >= 0 else total + 1 + layer for layer in layers]

    def embed_multimodal(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's encoder output: [its image tokens, the language model's width]."""
        pixel_values = data["pixel_values"].reshape(-1, *data["pixel_values"].shape[-3:])
        hidden_states = self.vision_tower(pixel_values.to(self.dtype), max(self.feature_layers))
        features = torch.cat([hidden_states[i] for i in self.feature_layers], dim=-1)
        if self.config.vision_feature_select_strategy == "default":
            features = features[:, 1:]  # CLIP's class token (transformers drops the first row)
        return self.multi_modal_projector(features).flatten(0, 1)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        parts = split_vlm_weights(
            weights,
            language=(
                ("language_model.", ""), ("model.language_model.", "model."), ("lm_head.", "lm_head."),
            ),
            modules={
                "vision_tower": (
                    ("vision_tower.vision_model.", ""), ("model.vision_tower.vision_model.", ""),
                    ("model.vision_tower.", ""), ("vision_tower.", ""),
                ),
                "multi_modal_projector": (
                    ("model.multi_modal_projector.", ""), ("multi_modal_projector.", ""),
                ),
            },
        )
        self.language_model.load_weights(parts.language)
        # SigLIP's attention-pooling head serves classification, not LLaVA.
        load_module_weights(self.vision_tower, parts.modules["vision_tower"], ignore=("head.",))
        load_module_weights(self.multi_modal_projector, parts.modules["multi_modal_projector"])
