"""SwiGLU's activation: silu(gate) * up over a merged gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenserve.kernels import layer_ops


class SiluAndMul(nn.Module):
    def __init__(self, dtype: torch.dtype, use_c_kernels: bool = True) -> None:
        super().__init__()
        self.dtype = dtype
        self.ops = layer_ops.load() if use_c_kernels and dtype == torch.float32 else None

    def forward(self, gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """[rows, 2 * d] → [rows, d], in `out_dtype` (default gate_up's). A bf16 model's
        product hands gate_up in bf16 and its next product reads bf16: computed in float32
        between (the C kernel without a cast pass)."""
        out_dtype = out_dtype or gate_up.dtype
        if self.ops is not None and gate_up.device.type == "cpu" and (
            gate_up.dtype == torch.float32 or out_dtype == torch.bfloat16
        ):
            return self.ops.silu_and_mul(gate_up, out_dtype)
        if gate_up.dtype != self.dtype:
            gate_up = gate_up.to(self.dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate) * up).to(out_dtype)
