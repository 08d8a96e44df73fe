"""Qwen3 (and Qwen3-Embedding): the llama layer stack with an RMSNorm on each query and key
head before rotary, and no q/k/v bias. Only the attention differs from model/llama.py."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from tokenserve.attention.backend import AttentionMetadata
from tokenserve.config import KernelConfig
from tokenserve.model.layers.layernorm import RMSNorm
from tokenserve.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class Qwen3Attention(LlamaAttention):
    def __init__(
        self, config, rotary_emb, backend, linear_method, dtype: torch.dtype, tp=None
    ) -> None:
        super().__init__(config, rotary_emb, backend, linear_method, dtype, tp)
        # Per head, over head_dim: one weight shared by every head.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, use_c_kernels=False)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, use_c_kernels=False)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.project_qkv(hidden_states).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        # Normed in place: q and k stay views of the fused QKV, as rotary's kernel reads them.
        q.copy_(self.q_norm(q))
        k.copy_(self.k_norm(k))
        q, k = self.rotary_emb(positions, q, k)
        return self.project_output(self.attn(q, k, v, kv_cache, metadata))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class: ClassVar[type[LlamaAttention]] = Qwen3Attention


class Qwen3Model(LlamaModel):
    decoder_layer_class: ClassVar[type[LlamaDecoderLayer]] = Qwen3DecoderLayer

    def __init__(
        self, config, dtype, backend, max_position, linear_method, kernel_config, parallel=None
    ) -> None:
        # The fused C decode layer knows no q/k norms: these layers run operator by operator.
        kernel_config = dataclasses.replace(
            kernel_config or KernelConfig(), disable_fused_decode=True
        )
        super().__init__(
            config, dtype, backend, max_position, linear_method, kernel_config, parallel
        )


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class: ClassVar[type[LlamaModel]] = Qwen3Model
