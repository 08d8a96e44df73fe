"""SwiGLU's activation: silu(gate) * up over a merged gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenserve.kernels import layer_ops


class SiluAndMul(nn.Module):
    def __init__(self, dtype: torch.dtype, use_c_kernels: bool = True) -> None:
        super().__init__()
        self.ops = layer_ops.load() if use_c_kernels and dtype == torch.float32 else None

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * d] → [rows, d]."""
        if self.ops is not None and gate_up.device.type == "cpu":
            return self.ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
