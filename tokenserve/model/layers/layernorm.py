"""RMSNorm, with the residual add fused in (the C kernel on CPU for float32 models, which
also reads and writes the bfloat16 of a bf16 model's products)."""

from __future__ import annotations

import torch
from torch import nn

from tokenserve.kernels import layer_ops


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, use_c_kernels: bool = True
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.ops = layer_ops.load() if use_c_kernels and dtype == torch.float32 else None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Normalise x; with `residual`, first add x into it in place (the residual stream)
        and normalise the sum. The result is in `out_dtype` (default: the weight's), e.g.
        bfloat16 when a bf16 product reads it."""
        out_dtype = out_dtype or self.weight.dtype
        if self.ops is not None and x.device.type == "cpu":
            return self.ops.rms_norm(x, self.weight, self.eps, residual, out_dtype)
        if residual is not None:
            x = residual.add_(x)
        # Normalise in fp32 whatever the dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(self.weight.dtype)).to(out_dtype)
