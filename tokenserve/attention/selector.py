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
) -> AttentionBackend:
    if device.type == "cpu":
        # The C decode kernel reads float32 queries; other dtypes take the pure-torch path.
        return TorchSDPABackend(
            use_kernels=use_c_kernels and dtype == torch.float32, cascade=cascade, device=device
        )
    raise ValueError(f"No attention backend for device type {device.type!r} yet (only 'cpu').")
