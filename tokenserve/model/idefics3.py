"""Idefics3 (`Idefics3ForConditionalGeneration`, SmolVLM): a SigLIP-style vision
transformer over an image's tiles, a pixel-shuffle connector, and a Llama-style language
model (SmolLM2; model/llama.py).

transformers' processor splits an image into tiles plus a downscaled global view (their
pixels arrive as [tiles, 3, H, W]); each tile's patches pass the vision transformer, then the
connector folds each 2-D neighbourhood of `scale_factor`² patches into one row
(pixel shuffle) and projects it to the language model's width: `image_seq_len` rows per
tile, in the order of the placeholder's image tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenserve.attention.backend import AttentionBackend
from tokenserve.config import KernelConfig
from tokenserve.model.layers.quantization import QuantizationMethod
from tokenserve.model.llava import VisionLanguageModel
from tokenserve.model.vision_encoder import VisionTransformer
from tokenserve.model.vision_weights import load_module_weights, split_vlm_weights


def pixel_shuffle(x: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """[tiles, side², D] → [tiles, (side / s)², D·s²]: each s×s block of patches into one
    row, its patches' features side by side (column pairs first, then row pairs)."""
    tiles, seq, dim = x.shape
    side = int(seq**0.5)
    s = scale_factor
    x = x.reshape(tiles, side, side // s, dim * s)  # neighbouring columns joined
    x = x.transpose(1, 2).reshape(tiles, side // s, side // s, dim * s * s)  # then rows
    return x.transpose(1, 2).reshape(tiles, seq // (s * s), dim * s * s)


class Idefics3Connector(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.scale_factor = config.scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(
            config.vision_config.hidden_size * config.scale_factor**2,
            config.text_config.hidden_size,
            bias=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(x, self.scale_factor))


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    def __init__(
        self,
        hf_config,
        dtype: torch.dtype,
        attention: AttentionBackend,
        max_position: int,
        linear_method: QuantizationMethod,
        kernel_config: KernelConfig,
    ) -> None:
        super().__init__(
            hf_config, dtype, attention, max_position, linear_method, kernel_config
        )
        self.vision_model = VisionTransformer(hf_config.vision_config, class_token=False)
        self.connector = Idefics3Connector(hf_config)
        self.vision_model.to(dtype)
        self.connector.to(dtype)

    def embed_multimodal(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's encoder output: [tiles × image_seq_len, the language model's width]."""
        pixel_values = data["pixel_values"]
        pixel_values = pixel_values.reshape(-1, *pixel_values.shape[-3:]).to(self.dtype)
        patch = self.config.vision_config.patch_size
        if "pixel_attention_mask" in data:
            pixel_mask = data["pixel_attention_mask"].reshape(-1, *pixel_values.shape[-2:]).bool()
        else:
            pixel_mask = torch.ones(pixel_values.shape[0], *pixel_values.shape[-2:], dtype=torch.bool)
        # Tiles of padding (all zeros) are not images.
        real = pixel_values.flatten(1).ne(0).any(dim=1)
        pixel_values, pixel_mask = pixel_values[real], pixel_mask[real]
        # A patch is real if any of its pixels is.
        patch_mask = pixel_mask.unfold(1, patch, patch).unfold(2, patch, patch).any(-1).any(-1)
        position_ids = self._position_ids(patch_mask)
        key_mask = None if bool(patch_mask.all()) else patch_mask.flatten(1)
        num_layers = self.config.vision_config.num_hidden_layers
        hidden = self.vision_model(pixel_values, num_layers, position_ids, key_mask)[-1]
        hidden = self.vision_model.post_layernorm(hidden)
        return self.connector(hidden).flatten(0, 1)

    def _position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """Each real patch's learned position: its fractional place in the tile's real area,
        bucketed onto the position grid (a full tile: 0, 1, 2, ... row by row)."""
        side = self.vision_model.embeddings.num_patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side)
        position_ids = torch.zeros(patch_mask.shape[0], patch_mask.shape[1] * patch_mask.shape[2],
                                   dtype=torch.long)
        for index, mask in enumerate(patch_mask):
            rows, cols = int(mask[:, 0].sum()), int(mask[0].sum())
            row_buckets = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / rows), boundaries, right=True)
            col_buckets = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / cols), boundaries, right=True)
            ids = (row_buckets[:, None] * side + col_buckets).flatten()
            position_ids[index][mask.flatten()] = ids
        return position_ids

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        parts = split_vlm_weights(
            weights,
            language=(("model.text_model.", "model."), ("lm_head.", "lm_head.")),
            modules={
                "vision_model": (("model.vision_model.", ""),),
                "connector": (("model.connector.", ""),),
            },
        )
        self.language_model.load_weights(parts.language)
        load_module_weights(self.vision_model, parts.modules["vision_model"])
        load_module_weights(self.connector, parts.modules["connector"])
