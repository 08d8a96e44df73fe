"""Which attention backend serves a device."""

from __future__ import annotations

import torch

from tokenserve.attention.backend import AttentionBackend
from tokenserve.attention.torch_sdpa import TorchSDPABackend


def get_attention_backend(
    device: torch.device,
    dtype: torch.dtype,
    cascade: bool = True,
    use_c_kernels: bool = True,
    weights_dtype: torch.dtype | None = None,
    split_decode: bool = True,
) -> AttentionBackend:
    """`dtype`: the activations'; `weights_dtype`: the model's (`--dtype`); `split_decode`:
    TorchSDPABackend's."""
    if device.type == "cpu":
        # The C decode kernel reads float32 queries; other dtypes take the pure-torch path.
        # Prompt chunks over a bf16 cache attend in bf16 only for a bf16 model (where the CPU
        # computes bf16 natively): a float32 model with a bf16 cache keeps float32 attention.
        return TorchSDPABackend(
            use_kernels=use_c_kernels and dtype == torch.float32, cascade=cascade, device=device,
            native_bf16=None if weights_dtype == torch.bfloat16 else False,
            split_decode=split_decode,
        )
    raise ValueError(f"No attention backend for device type {device.type!r} yet (only 'cpu').")
