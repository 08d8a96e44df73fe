"""The vision transformers of the vision-language models: CLIP, SigLIP and Idefics3's.

Plain torch (nn.Linear, F.scaled_dot_product_attention): images run once per image (the
encoder cache keeps their outputs), never on the KV path, so the paged attention and the
quantized layers have nothing to do here. Parameter names are the checkpoints' own
(`embeddings.*`, `encoder.layers.N.*`, `pre_layrnorm`, `post_layernorm`), so a state dict
loads as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


class VisionAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = (
            proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, hidden))


class VisionMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            VisionEncoderLayer(config) for _ in range(config.num_hidden_layers)
        )


class VisionEmbeddings(nn.Module):
    """Patches (a strided convolution) plus learned positions; CLIP adds a class token."""

    def __init__(self, config, class_token: bool) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, hidden, patch, stride=patch, bias=not class_token
        )
        self.num_patches_per_side = config.image_size // patch
        num_positions = self.num_patches_per_side**2 + (1 if class_token else 0)
        self.position_embedding = nn.Embedding(num_positions, hidden)
        if class_token:
            self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.has_class_token = class_token

    def forward(
        self, pixel_values: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        x = patches.flatten(2).transpose(1, 2)
        if self.has_class_token:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        if position_ids is None:
            return x + self.position_embedding.weight[: x.shape[1]]
        return x + self.position_embedding(position_ids)


class VisionTransformer(nn.Module):
    """CLIP (`class_token`: a class token and `pre_layrnorm`) or SigLIP / Idefics3 (neither).

    `forward` returns the hidden states as transformers numbers them (0: the embeddings as
    the first layer sees them, i: after layer i) up to layer `num_layers`, without
    `post_layernorm`, which callers apply when they use it.
    """

    def __init__(self, config, class_token: bool) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config, class_token)
        if class_token:
            self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self,
        pixel_values: torch.Tensor,
        num_layers: int,
        position_ids: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        x = self.embeddings(pixel_values, position_ids)
        if hasattr(self, "pre_layrnorm"):
            x = self.pre_layrnorm(x)
        hidden_states = [x]
        for layer in self.encoder.layers[:num_layers]:
            x = layer(x, key_mask)
            hidden_states.append(x)
        return hidden_states
