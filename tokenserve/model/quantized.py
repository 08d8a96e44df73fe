"""GGUF's block-quantized weights kept beside the float32 ones, for decode's products.

A decode step with few rows reads every weight once and does little with it, so its time
is the time to stream the weights from memory. For a GGUF model the projections (Q4_1
here) and the logits matrix (Q8_0) are also kept in their file's block form, ~5x and ~4x
smaller than float32, and `linear()` sends products of at most `max_rows` rows to the C
kernels of kernels/csrc/quant_linear.c, which expand the blocks in registers with the same
float32 arithmetic as gguf's dequantization: the very weights of the float32 path, read in
a fifth of the bytes. Products of more rows, up to `gemm_max_rows`, go to its many-row
kernel, which expands each weight once per call into a cache-resident float32 panel and
multiplies it into all rows (a GEMM micro-kernel); that needs the output rows in
multiples of 16. Larger products stay on oneDNN's float32 GEMM, which is as fast once the
weights are reused across enough rows (measured in docs/BENCHMARKS.md).

`TOKENSERVE_QUANTIZED_MAX_ROWS` sets the few-row kernel's limit (default 10) and
`TOKENSERVE_QUANTIZED_GEMM_MAX_ROWS` the many-row kernel's (default 192); 0 turns a kernel
off, both 0 the path.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import numpy as np
import torch

from tokenserve.kernels import BoundQuantLinear, QuantLinearOps, quant_linear

MAX_ROWS_ENV = "TOKENSERVE_QUANTIZED_MAX_ROWS"
GEMM_MAX_ROWS_ENV = "TOKENSERVE_QUANTIZED_GEMM_MAX_ROWS"
# The crossovers of the two kernels with each other and with oneDNN's prepacked float32
# GEMM on this project's 2-core machine, for SmolLM2-135M's shapes streamed from memory
# (benchmarks/quantized_linear.py, figures in docs/BENCHMARKS.md).
DEFAULT_MAX_ROWS = 10
DEFAULT_GEMM_MAX_ROWS = 192
BLOCK = 32
# GGML type names → the bytes of one 32-weight block.
_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
QUANTIZED_KINDS = tuple(_BLOCK_BYTES)


def max_rows() -> int:
    return _row_limit(MAX_ROWS_ENV, DEFAULT_MAX_ROWS)


def gemm_max_rows() -> int:
    return _row_limit(GEMM_MAX_ROWS_ENV, DEFAULT_GEMM_MAX_ROWS)


def _row_limit(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError as error:
        raise ValueError(f"{name} must be an integer, got {value!r}.") from error


@dataclass
class QuantizedWeight:
    """A [out, in] weight in GGUF blocks, repacked for quant_linear.c:
    Q4_1: qs uint8 [out, in / 2] (a block's 16 bytes as in the file), scales float32
    [out, in / 32, 2] (d, m); Q8_0: qs int8 [out, in], scales float32 [out, in / 32]."""

    kind: str  # "Q4_1" or "Q8_0"
    qs: torch.Tensor
    scales: torch.Tensor
    # linear() uses this copy for products of at most max_rows rows (the few-row kernel)
    # and, above that, of at most gemm_max_rows rows (the many-row kernel).
    max_rows: int = DEFAULT_MAX_ROWS
    gemm_max_rows: int = DEFAULT_GEMM_MAX_ROWS

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.scales.shape[1] * BLOCK

    @classmethod
    def from_blocks(cls, kind: str, blocks: np.ndarray) -> QuantizedWeight:
        """From a GGUF tensor's raw bytes, one row of blocks per output: [out, in / 32 * block bytes]."""
        if kind not in _BLOCK_BYTES:
            raise ValueError(f"No quantized kernel for {kind}; have {sorted(_BLOCK_BYTES)}.")
        rows = blocks.shape[0]
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows, -1, _BLOCK_BYTES[kind])
        num_blocks = blocks.shape[1]
        # The block's float16 fields become float32 (exactly), as gguf's dequantization does.
        d = blocks[:, :, 0:2].copy().view(np.float16).astype(np.float32)
        if kind == "Q4_1":
            m = blocks[:, :, 2:4].copy().view(np.float16).astype(np.float32)
            qs = blocks[:, :, 4:].reshape(rows, num_blocks * 16)
            scales = np.concatenate([d, m], axis=2)
        else:
            qs = blocks[:, :, 2:].reshape(rows, num_blocks * BLOCK).view(np.int8)
            scales = d.reshape(rows, num_blocks)
        return cls(kind, torch.from_numpy(np.ascontiguousarray(qs)),
                   torch.from_numpy(np.ascontiguousarray(scales)))

    def map_rows(self, function) -> QuantizedWeight:
        """The same weight with its output rows rearranged by `function` (a row permutation
        written for [out, ...] tensors)."""
        return replace(self, qs=function(self.qs), scales=function(self.scales))

    @staticmethod
    def concat(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
        """Parts stacked along the output rows (fused q/k/v, gate/up); None if they differ in kind."""
        if len({part.kind for part in parts}) != 1 or len({part.shape[1] for part in parts}) != 1:
            return None
        return replace(
            parts[0],
            qs=torch.cat([part.qs for part in parts]),
            scales=torch.cat([part.scales for part in parts]),
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (what gguf's dequantization gives), for tests and checks."""
        if self.kind == "Q4_1":
            qs = self.qs.reshape(self.qs.shape[0], -1, 16)
            q = torch.cat([qs & 0x0F, qs >> 4], dim=2).to(torch.float32)
            weight = q * self.scales[:, :, 0:1] + self.scales[:, :, 1:2]
        else:
            q = self.qs.reshape(self.qs.shape[0], -1, BLOCK).to(torch.float32)
            weight = q * self.scales[:, :, None]
        return weight.reshape(self.shape)

    @property
    def _fits_panels(self) -> bool:
        """Whether the many-row kernel takes this weight (its output rows in whole panels)."""
        return self.shape[0] % QuantLinearOps.PANEL == 0

    @property
    def row_limit(self) -> int:
        """The most rows of a product linear() sends here: the few-row kernel's limit, or
        the many-row kernel's where the weight fits its panels."""
        return max(self.max_rows, self.gemm_max_rows if self._fits_panels else 0)

    def takes(self, rows: int) -> bool:
        """Whether linear() sends a product of `rows` rows here (else to oneDNN)."""
        return rows <= self.row_limit

    def matmul(self, x: torch.Tensor, panels: bool | None = None) -> torch.Tensor:
        """x [rows, in] float32 → x · Wᵀ [rows, out]. `panels` picks the kernel; by
        default the many-row one for more than max_rows rows, where it applies."""
        if panels is None:
            panels = x.shape[0] > self.max_rows and self._fits_panels
        return self._kernels(x.contiguous(), panels)

    @functools.cached_property
    def _kernels(self) -> BoundQuantLinear:
        """The kernels bound to this weight (checked once; qs and scales are not reassigned:
        map_rows and concat make new weights)."""
        ops = quant_linear()
        if ops is None:
            raise RuntimeError("the quantized linear kernel is unavailable")
        return ops.bind(self.kind, self.qs, self.scales)


def kernels_available() -> bool:
    return max(max_rows(), gemm_max_rows()) > 0 and quant_linear() is not None


def usable_for(weight: QuantizedWeight, shape: tuple[int, ...]) -> bool:
    """Whether the kernels can stand in for a float32 weight of `shape` with this copy."""
    rows, width = weight.shape
    return tuple(shape) == (rows, width) and width % BLOCK == 0
