"""Rotary position embeddings: a cos/sin table indexed by position.

Inverse frequencies come from transformers' own RoPE initialisers for scaled variants
(linear, llama3, yarn, ...), so every rope_type means what it means there. They are imported
only for those: the default RoPE needs no transformers, so the engine process of a GGUF
model never imports it (docs/STARTUP.md).
"""

from __future__ import annotations

import torch

from tokenserve.kernels import layer_ops


def _rope_parameters(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def compute_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = _rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: default, "
            f"{', '.join(sorted(set(ROPE_INIT_FUNCTIONS) - {'dynamic'}))}."
        )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(torch.nn.Module):
    def __init__(
        self,
        hf_config,
        head_dim: int,
        max_position: int,
        dtype: torch.dtype,
        use_c_kernels: bool = True,
    ) -> None:
        super().__init__()
        inv_freq, attention_scaling = compute_inv_freq(hf_config, head_dim)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (angles.cos() * attention_scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (angles.sin() * attention_scaling).to(dtype), persistent=False)
        self.ops = layer_ops.load() if use_c_kernels and dtype == torch.float32 else None

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, H, D] and key [T, Hkv, D] by their positions [T].

        On CPU with the C kernels, in place (query and key may be views of one fused QKV
        tensor); otherwise new tensors."""
        if self.ops is not None and self.cos.device.type == "cpu":
            self.ops.rotary(query, key, positions, self.cos, self.sin)
            return query, key
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


    def forward_qkv(
        self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query, key, value) [T, heads, D] of a fused q/k/v product [T, width] in the
        table's dtype, query and key rotated. A bf16 product's q/k/v is cast and rotated in
        one pass on CPU with the C kernels."""
        head_dim = self.cos.shape[1]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        if self.ops is not None and qkv.dtype == torch.bfloat16 and qkv.device.type == "cpu":
            qkv = self.ops.rotary_from_bf16(
                qkv.contiguous(), positions, self.cos, self.sin, num_heads, num_kv_heads
            )
            rotated = True
        else:
            qkv = qkv.to(self.cos.dtype)
            rotated = False
        tokens = qkv.shape[0]
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(tokens, num_heads, head_dim)
        k = k.view(tokens, num_kv_heads, head_dim)
        v = v.view(tokens, num_kv_heads, head_dim)
        if not rotated:
            q, k = self(positions, q, k)
        return q, k, v


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
