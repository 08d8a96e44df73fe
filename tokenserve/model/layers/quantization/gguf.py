"""GGUF's block-quantized weights kept beside the float32 ones, for decode's products.

A decode step with few rows reads every weight once and does little with it, so its time
is the time to stream the weights from memory. For a GGUF model the projections (Q4_1
here) and the logits matrix (Q8_0) are also kept in their file's block form, ~5x and ~4x
smaller than float32, and `GGUFLinearMethod` sends products of at most `max_rows` rows to
the C kernels of kernels/csrc/quant_linear.c, which expand the blocks in registers with the
same float32 arithmetic as gguf's dequantization: the very weights of the float32 path,
read in a fifth of the bytes. Products of more rows, up to `gemm_max_rows`, go to its
many-row kernel, which expands each weight once per call into a cache-resident float32
panel and multiplies it into all rows (a GEMM micro-kernel); that needs the output rows in
multiples of 16. Larger products stay on oneDNN's float32 GEMM, which is as fast once the
weights are reused across enough rows (docs/benchmarks/cpu-hot-path.md). The row limits
are `KernelConfig.quantized_max_rows` / `quantized_gemm_max_rows`.

A bfloat16 model on the amx level sends its products of AMX_MIN_ROWS (4) to `amx_max_rows`
rows (`KernelConfig.bf16_block_max_rows`) to the AMX kernel instead (csrc/quant_amx.h): the
bf16 model's own numerics (each weight expanded as above, then rounded to bf16 as the dense
bf16 weight is; x rounded to bf16; float32 sums, each rounded to bf16 as oneDNN rounds
its own), from the blocks; in an engine step faster than oneDNN's bf16 GEMM on the dense
weights up to 1024 rows (docs/PERFORMANCE_CPU.md). It reads bf16 x and writes bf16 sums, as
oneDNN's bf16 products do (`reads_bf16`, `input_dtype`). Its products of up to 3 rows keep
the float32 few-row kernel (float32 weights and inputs, as without AMX): there the weights'
bytes and their expansion set the time, and the AMX kernel's expansion to bf16 and its
tile loads cost more than its products save. With `batch_invariant` every product takes the AMX
kernel, one row included, so that a row's sums never depend on the batch
(docs/PERFORMANCE_CPU.md, "Outputs independent of the batch").

On the avx512_bf16 level (AVX512_BF16 without AMX, or that level forced) a bfloat16 model
sends its products of at most `dp_max_rows` rows (the same `bf16_block_max_rows` setting,
128 there) to the vdpbf16ps kernel (csrc/quant_dp.h) with those same numerics, from one
row, in its dot-product form up to DP_FEW_ROWS rows and its panel form above: its decode
steps then compute what its larger products do on oneDNN, up to the order of the float32
sums (tests/kernels/test_quant_linear_bf16.py: all but ~1e-4 of the outputs bit for bit).

On every x86-64 level products of at most `i8_max_rows` rows take the kernel of x rounded
to 8 bits per 32-value block instead of any of the above (csrc/quant_i8.h;
`KernelConfig.int8_activation_rows`: 4 for a bfloat16 model by default, none for a float32
one): the file's weights times x on an 8-bit grid, integer products by vpdpbusd (AVX512-VNNI,
the avx512_bf16 and amx levels) or vpmaddubsw (AVX2, below them), as llama.cpp's and vLLM's
GGUF kernels compute; float32 in and out. It reads a
copy of the blocks in its own layout (panels of 16 output rows, the file's bytes and float16
scales: `i8_weight`), made at load for every weight it will take. At one to four rows that
is the fastest way through the blocks (docs/PERFORMANCE_CPU.md, "Few-row products
with x rounded to 8 bits"); its error is of the order of the bf16 path's rounding
(tests/model/test_int8_activations.py).
"""

from __future__ import annotations

import functools
import itertools
import threading
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from tokenserve.config import DEFAULT_QUANTIZED_GEMM_MAX_ROWS, DEFAULT_QUANTIZED_MAX_ROWS
from tokenserve.kernels import quant_linear
from tokenserve.kernels.quant_linear import BLOCK, BoundQuantLinear, QuantLinearOps
from tokenserve.model.layers.quantization.unquantized import UnquantizedLinearMethod
from tokenserve.model.layers.weight_loading import Rows

# A bf16 model on amx: products of fewer rows keep the float32 few-row kernel, which streams
# the blocks faster than the AMX kernel expands them to bf16 (decode steps of the default
# model with it at 1-3 rows, 16 lanes wide on AVX-512, against the AMX kernel: 2 rows 10.0-
# 10.3 vs 12.4-12.7 ms, 3 rows 11.8-12.0 vs 13.2-13.3, 4 rows about the same;
# docs/PERFORMANCE_CPU.md, "The few-row float32 kernel on AVX-512").
AMX_MIN_ROWS = 4

# A bf16 model on avx512_bf16: products of up to this many rows take the vdpbf16ps kernel's
# dot-product form, more its panel form (csrc/quant_dp.h), which expands a panel of weight
# rows once per call and needs more rows to repay that: the forms tie at about 8 rows
# (`python benchmarks/quantized_linear.py --dtype bfloat16` prints both;
# docs/PERFORMANCE_CPU.md, "The vdpbf16ps kernel's panel form").
DP_FEW_ROWS = 8

# GGML type names → the bytes of one 32-weight block.
_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
QUANTIZED_KINDS = tuple(_BLOCK_BYTES)


@dataclass
class QuantizedWeight:
    """A [out, in] weight in GGUF blocks, repacked for quant_linear.c:
    Q4_1: qs uint8 [out, in / 2] (a block's 16 bytes as in the file), scales float32
    [out, in / 32, 2] (d, m); Q8_0: qs int8 [out, in], scales float32 [out, in / 32]."""

    kind: str  # "Q4_1" or "Q8_0"
    qs: torch.Tensor
    scales: torch.Tensor
    # Products of at most max_rows rows take the few-row kernel and, above that, of at most
    # gemm_max_rows rows the many-row kernel.
    max_rows: int = DEFAULT_QUANTIZED_MAX_ROWS
    gemm_max_rows: int = DEFAULT_QUANTIZED_GEMM_MAX_ROWS
    # A bfloat16 model on the amx level: products of at most this many rows take the AMX
    # kernel, bf16 numerics (0: none; the limits above then apply).
    amx_max_rows: int = 0
    # A bfloat16 model on the avx512_bf16 level: products of at most this many rows take the
    # vdpbf16ps kernel, the same numerics (0: none).
    dp_max_rows: int = 0
    # With the AMX kernel: products of fewer rows take the float32 few-row kernel (1 with
    # batch_invariant: every product on the AMX kernel).
    amx_min_rows: int = AMX_MIN_ROWS
    # Products of at most this many rows take the kernel of x rounded to 8 bits per block
    # (csrc/quant_i8.h), whatever the limits above say (0: none).
    i8_max_rows: int = 0

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

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Output rows (dim 0) or input columns (dim 1, whole blocks) start:start+length, as
        Tensor.narrow: a tensor-parallel shard of the weight."""
        if dim == 0:
            return replace(self, qs=self.qs[start : start + length],
                           scales=self.scales[start : start + length])
        if dim != 1 or start % BLOCK or length % BLOCK:
            raise ValueError("GGUF blocks split along the input only at whole 32-weight blocks.")
        per_byte = 2 if self.kind == "Q4_1" else 1
        return replace(
            self,
            qs=self.qs[:, start // per_byte : (start + length) // per_byte].contiguous(),
            scales=self.scales[:, start // BLOCK : (start + length) // BLOCK].contiguous(),
        )

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
    def uses_amx(self) -> bool:
        """Whether products take the AMX kernel (bf16 numerics; its panels are the many-row
        kernel's)."""
        return self.amx_max_rows > 0 and self._fits_panels

    @property
    def uses_dp(self) -> bool:
        """Whether products take the vdpbf16ps kernel (bf16 numerics; from one row)."""
        return self.dp_max_rows > 0 and self._fits_panels

    @property
    def row_limit(self) -> int:
        """The most rows of a product sent here: the AMX or vdpbf16ps kernel's limit where
        one applies, else the few-row kernel's, or the many-row kernel's where the weight fits
        its panels."""
        if self.uses_amx:
            return max(self.amx_max_rows, self.i8_max_rows)
        if self.uses_dp:
            return max(self.dp_max_rows, self.i8_max_rows)
        return max(self.max_rows, self.gemm_max_rows if self._fits_panels else 0,
                   self.i8_max_rows)

    def takes(self, rows: int) -> bool:
        """Whether a product of `rows` rows is sent here (else to the float weight)."""
        return rows <= self.row_limit

    def reads_bf16(self, rows: int) -> bool:
        """Whether a product of `rows` rows (one it takes) may read bf16 x: on the AMX
        kernel, which then writes its sums in bf16 too (the same values)."""
        return self.uses_amx and rows >= self.amx_min_rows and rows > self.i8_max_rows

    def matmul(self, x: torch.Tensor, panels: bool | None = None,
               amx: bool | None = None, dp: bool | None = None,
               i8: bool | None = None) -> torch.Tensor:
        """x [rows, in] float32 → x · Wᵀ [rows, out] float32 (on the AMX kernel x may be
        bf16, and the result is then bf16: `reads_bf16`). By default where the AMX
        kernel applies (uses_amx) it for amx_min_rows rows or more and the few-row kernel
        below; where the vdpbf16ps kernel applies (uses_dp) it, in its panel form above
        DP_FEW_ROWS rows; elsewhere the many-row kernel for more than max_rows rows where it
        applies, else the few-row one; all of those only above i8_max_rows rows, the 8-bit
        kernel's. `amx`, `dp` (with `panels` the panel form), `i8` or `panels` pick one
        (benchmarks, tests)."""
        chosen = amx is not None or dp is not None or panels is not None or i8 is not None
        if i8 or (not chosen and x.shape[0] <= self.i8_max_rows):
            return self._kernels(x.contiguous(), i8=True)
        if amx is None and dp is None and panels is None and self.uses_amx:
            # (The few-row kernel below amx_min_rows whatever max_rows: as the fused layer.)
            amx, panels = x.shape[0] >= self.amx_min_rows, False
        if amx is None and dp is None and panels is None and self.uses_dp:
            dp, panels = True, x.shape[0] > DP_FEW_ROWS
        if amx:
            return self._kernels(x.contiguous(), amx=True)
        if dp:
            return self._kernels(x.contiguous(), **{"dp_panels" if panels else "dp": True})
        if panels is None:
            panels = x.shape[0] > self.max_rows and self._fits_panels
        return self._kernels(x.contiguous(), panels)

    def i8_weight(self) -> torch.Tensor:
        """The weight's copy in the 8-bit kernel's layout (csrc/quant_i8.h, made once)."""
        return self._kernels.i8_weight()

    def resident_tensors(self) -> list[torch.Tensor]:
        """What this weight's products read step after step: the blocks, and the 8-bit
        kernel's copy where products of few rows take it (made here if not yet, as the
        first such product would make it)."""
        tensors = [self.qs, self.scales]
        if self.i8_max_rows:
            tensors.append(self.i8_weight())
        return tensors

    @functools.cached_property
    def _kernels(self) -> BoundQuantLinear:
        """The kernels bound to this weight (checked once; qs and scales are not reassigned:
        map_rows, narrow and concat make new weights)."""
        ops = quant_linear.load()
        if ops is None:
            raise RuntimeError("the quantized linear kernel is unavailable")
        return ops.bind(self.kind, self.qs, self.scales)


class GGUFLinearMethod(UnquantizedLinearMethod):
    """A GGUF model's linear layers: the dense (oneDNN-packed) float32 weight, dequantized
    from the file, and beside it the file's Q4_1 / Q8_0 blocks (`layer.blocks`) for products
    of few rows. A layer whose checkpoint parts are not all in one of those kinds keeps the
    dense weight alone."""

    def __init__(self, max_rows: int, gemm_max_rows: int, use_onednn: bool = True,
                 weight_dtype: torch.dtype | None = None, amx_max_rows: int = 0,
                 dp_max_rows: int = 0, batch_invariant: bool = False,
                 i8_max_rows: int = 0) -> None:
        super().__init__(use_onednn, weight_dtype)
        self.max_rows, self.gemm_max_rows = max_rows, gemm_max_rows
        self.amx_max_rows = amx_max_rows  # QuantizedWeight.amx_max_rows
        self.dp_max_rows = dp_max_rows  # QuantizedWeight.dp_max_rows
        self.i8_max_rows = i8_max_rows  # QuantizedWeight.i8_max_rows
        # KernelConfig.batch_invariant: every layer's products on the AMX kernel, from 1 row.
        self.batch_invariant = batch_invariant
        self.num_block_weights = 0  # how many layers got their blocks, for the log
        self._count_lock = threading.Lock()  # layers are processed on a load's workers

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        super().create_weights(layer, input_size_per_partition, output_partition_sizes,
                               params_dtype)
        layer.gguf_parts = {}  # first output row → the blocks loaded for the rows from there
        layer.blocks = None

    def load_weight(self, layer: nn.Module, loaded_weight, rows: Rows) -> None:
        if not isinstance(loaded_weight, QuantizedWeight):
            super().load_weight(layer, loaded_weight, rows)
            return
        first, count = rows if rows is not None else (0, layer.weight.shape[0])
        if loaded_weight.shape[0] != count:
            raise ValueError(f"GGUF blocks of {loaded_weight.shape[0]} rows for {count} rows.")
        layer.gguf_parts[first] = loaded_weight

    def process_weights_after_loading(self, layer: nn.Module, pack: bool = True) -> None:
        if layer.gguf_parts:
            layer.blocks = self._join(layer.gguf_parts, tuple(layer.weight.shape))
            layer.gguf_parts = {}
            with self._count_lock:
                self.num_block_weights += layer.blocks is not None
        if self.batch_invariant and (layer.blocks is None or not layer.blocks.uses_amx):
            raise ValueError(
                f"batch_invariant: a weight of shape {tuple(layer.weight.shape)} is not in "
                f"blocks the AMX kernel takes ({', '.join(QUANTIZED_KINDS)}, whole 16-row "
                "panels); its products would go to oneDNN, whose sums depend on the batch."
            )
        super().process_weights_after_loading(layer, pack)

    def _join(
        self, parts: dict[int, QuantizedWeight], shape: tuple[int, ...]
    ) -> QuantizedWeight | None:
        """The parts as one weight of `shape` (fused q/k/v, gate/up), if they cover it in one
        kind the kernels take; else None."""
        firsts = sorted(parts)
        ordered = [parts[first] for first in firsts]
        joined = QuantizedWeight.concat(ordered)
        # Each part starts where the one before ends.
        covered = firsts == [0, *itertools.accumulate(part.shape[0] for part in ordered)][:-1]
        if joined is None or not covered or joined.shape != shape:
            return None
        joined = replace(joined, max_rows=self.max_rows, gemm_max_rows=self.gemm_max_rows,
                         amx_max_rows=self.amx_max_rows, dp_max_rows=self.dp_max_rows,
                         amx_min_rows=1 if self.batch_invariant else AMX_MIN_ROWS,
                         i8_max_rows=self.i8_max_rows)
        if joined.i8_max_rows:
            joined.i8_weight()  # its copy for the 8-bit kernel made at load, not in a step
        return joined

    def input_dtype(self, layer: nn.Module, rows: int) -> torch.dtype | None:
        """The blocks' AMX kernel reads bf16, as the dense bf16 products do (the operator
        before rounds its result into bf16 once, and the sums come back in bf16); their
        other kernels read float32; the dense products as the base method says."""
        blocks = layer.blocks
        if blocks is not None and blocks.takes(rows):
            return torch.bfloat16 if blocks.reads_bf16(rows) else None
        return super().input_dtype(layer, rows)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        blocks = layer.blocks
        if blocks is not None and x.dim() == 2 and blocks.takes(x.shape[0]):
            if x.dtype == torch.bfloat16 and blocks.reads_bf16(x.shape[0]):
                # bf16 in, its sums in bf16 out; a bias is added in float32, as the dense
                # bf16 product adds it.
                out = blocks.matmul(x)
                return out if bias is None else out.float().add_(bias)
            out = blocks.matmul(x.float())  # the other kernels read float32
            return out if bias is None else out.add_(bias)
        return super().apply(layer, x, bias)

    def __str__(self) -> str:
        kernels = (f"{self.amx_max_rows} rows (AMX, bf16"
                   + (", from one row: batch-invariant)" if self.batch_invariant else ")")
                   if self.amx_max_rows
                   else f"{self.dp_max_rows} rows (vdpbf16ps, bf16)" if self.dp_max_rows
                   else f"{max(self.max_rows, self.gemm_max_rows)} rows")
        rounded = (f" (up to {self.i8_max_rows} rows with x rounded to 8 bits)"
                   if self.i8_max_rows else "")
        return (f"{self.num_block_weights} weights also in their GGUF blocks for products of up "
                f"to {kernels}{rounded}; " + super().__str__())
