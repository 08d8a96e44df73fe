"""Bindings of csrc/quant_linear.c: y = x · Wᵀ with W in GGUF's Q4_1 or Q8_0 blocks, in the
layouts of model/layers/quantization/gguf.py's `QuantizedWeight` (see quant_linear.c).
The float32 few-row and many-row kernels per format, and with a bfloat16 model's numerics
on the amx level the AMX one (csrc/quant_amx.h; `QuantLinearOps.amx`), on the avx512_bf16
level the vdpbf16ps ones (csrc/quant_dp.h; `QuantLinearOps.dp`): its dot-product form for
few rows and its panel form for many; on every x86-64 level the few-row kernel of x rounded
to 8 bits per block (csrc/quant_i8.h; `QuantLinearOps.i8`)."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenserve.kernels import build
from tokenserve.kernels.tensor_checks import check_f32, i64, ptr

BLOCK = 32  # weights per GGUF block
# Why the kernel of x rounded to 8 bits (QuantLinearOps.i8) is refused where it is not built.
_I8_UNAVAILABLE = "the 8-bit quantized kernel needs an x86-64 level (AVX2 and up)."


class QuantLinearOps:
    """The kernels per format: the few-row kernel, with `panels=True` the many-row one
    (output rows a multiple of `PANEL`), with `amx=True` the bf16 AMX one (the same
    multiple; only where `amx` is true), with `dp=True` the bf16 vdpbf16ps one and with
    `dp_panels=True` its panel form (a multiple of 16 output rows; both only where `dp` is
    true)."""

    PANEL = 16

    def __init__(self, library: ctypes.CDLL) -> None:
        self._kernels = {
            ("Q4_1", "few"): library.ts_q4_1_linear_f32,
            ("Q8_0", "few"): library.ts_q8_0_linear_f32,
            ("Q4_1", "panels"): library.ts_q4_1_gemm_f32,
            ("Q8_0", "panels"): library.ts_q8_0_gemm_f32,
            ("Q4_1", "amx"): library.ts_q4_1_gemm_amx,
            ("Q8_0", "amx"): library.ts_q8_0_gemm_amx,
            ("Q4_1", "amx_bf16"): library.ts_q4_1_gemm_amx_bf16,
            ("Q8_0", "amx_bf16"): library.ts_q8_0_gemm_amx_bf16,
            ("Q4_1", "dp"): library.ts_q4_1_linear_dp,
            ("Q8_0", "dp"): library.ts_q8_0_linear_dp,
            ("Q4_1", "dp_panels"): library.ts_q4_1_gemm_dp,
            ("Q8_0", "dp_panels"): library.ts_q8_0_gemm_dp,
        }
        for function in self._kernels.values():
            function.restype = ctypes.c_int
            function.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr]
        # The 8-bit kernel reads the weight in its own layout (repack_i8), either kind.
        self._i8_kernel = library.ts_linear_i8
        self._i8_kernel.restype = ctypes.c_int
        self._i8_kernel.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64]
        self._i8_repack = library.ts_i8_repack
        self._i8_repack.restype = ctypes.c_int
        self._i8_repack.argtypes = [ptr, ptr, ptr, i64, i64, i64]
        self._i8_weight_bytes = library.ts_i8_weight_bytes
        self._i8_weight_bytes.restype = i64
        self._i8_weight_bytes.argtypes = [i64, i64, i64]
        available = library.ts_quant_amx_available
        available.restype = ctypes.c_int
        # Whether the AMX kernel runs here: built for the amx level, the tiles granted.
        self.amx = bool(available())
        # Whether the vdpbf16ps kernel runs here: built for the avx512_bf16 level.
        self.dp = bool(library.ts_quant_dp_available())
        # Whether the kernel of x rounded to 8 bits runs here: built on the x86-64 levels
        # (vpdpbusd with AVX512-VNNI, vpmaddubsw with AVX2).
        self.i8 = bool(library.ts_quant_i8_available())

    def repack_i8(self, kind: str, qs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The weight's blocks copied into the 8-bit kernel's layout (quant_i8.h, i8_repack:
        panels of 16 output rows, the file's bytes and float16 scales), uint8."""
        if not self.i8:
            raise RuntimeError(_I8_UNAVAILABLE)
        width = check_weight(kind, qs, scales)
        q4_1 = int(kind == "Q4_1")
        out = torch.empty(self._i8_weight_bytes(qs.shape[0], width, q4_1), dtype=torch.uint8)
        status = self._i8_repack(out.data_ptr(), qs.data_ptr(), scales.data_ptr(), qs.shape[0],
                                 width, q4_1)
        if status != 0:
            raise ValueError(f"the 8-bit kernel's layout needs whole {BLOCK}-weight blocks.")
        return out

    def bind(self, kind: str, qs: torch.Tensor, scales: torch.Tensor) -> BoundQuantLinear:
        """Both kernels of one weight, the weight checked once: a decode step makes ~120 of
        these small products, so per-call checks of the weight would be a sizeable share of
        them."""
        check_weight(kind, qs, scales)
        amx = (self._kernels[kind, "amx"], self._kernels[kind, "amx_bf16"]) if self.amx else None
        return BoundQuantLinear(self._kernels[kind, "few"], self._kernels[kind, "panels"], amx,
                                self._kernels[kind, "dp"] if self.dp else None,
                                self._kernels[kind, "dp_panels"] if self.dp else None,
                                self._i8_kernel if self.i8 else None,
                                qs, scales, functools.partial(self.repack_i8, kind, qs, scales))


class BoundQuantLinear:
    """y = x · Wᵀ for one checked weight (`QuantLinearOps.bind`): each call checks only x."""

    __slots__ = ("_amx", "_amx_bf16", "_dp", "_dp_panels", "_few", "_i8", "_i8_repack",
                 "_i8_weight", "_many", "_num_out", "_qs", "_scales", "_width")

    def __init__(self, few, many, amx, dp, dp_panels, i8, qs: torch.Tensor,
                 scales: torch.Tensor, i8_repack=None) -> None:
        # amx: the AMX kernel on float32 and on bf16 x and y, or None.
        self._amx, self._amx_bf16 = amx if amx is not None else (None, None)
        self._few, self._many, self._dp = few, many, dp
        self._dp_panels, self._i8 = dp_panels, i8
        # The tensors are held so that their memory outlives the pointers passed to C.
        self._qs, self._scales = qs, scales
        self._num_out, self._width = qs.shape[0], scales.shape[1] * BLOCK
        # The 8-bit kernel's copy of the weight, made at its first use (i8_weight()).
        self._i8_repack, self._i8_weight = i8_repack, None

    def i8_weight(self) -> torch.Tensor:
        """The weight in the 8-bit kernel's layout (QuantLinearOps.repack_i8), made once."""
        if self._i8_weight is None:
            if self._i8 is None:
                raise RuntimeError(_I8_UNAVAILABLE)
            self._i8_weight = self._i8_repack()
        return self._i8_weight

    def __call__(self, x: torch.Tensor, panels: bool = False, amx: bool = False,
                 dp: bool = False, dp_panels: bool = False, i8: bool = False) -> torch.Tensor:
        """x [M, K] float32, contiguous → [M, N] float32; `panels` picks the many-row kernel,
        `amx` the AMX one, `dp` the vdpbf16ps one and `dp_panels` its panel form (those
        three: x and the weights rounded to bf16, float32 sums, each rounded to bf16 as
        oneDNN's bf16 GEMM hands its sums on), `i8` the one of x rounded to 8 bits per block
        (quant_i8.h). The AMX kernel also takes bf16 x, and then writes its sums as bf16
        (the same values)."""
        if amx and self._amx is None:
            raise RuntimeError("the AMX quantized kernel is not available on this level/CPU.")
        if (dp or dp_panels) and self._dp is None:
            raise RuntimeError("the vdpbf16ps quantized kernel is not available on this level.")
        if i8 and self._i8 is None:
            raise RuntimeError(_I8_UNAVAILABLE)
        bf16 = amx and x.dtype == torch.bfloat16
        if (x.dtype != torch.float32 and not bf16) or not x.is_cpu or not x.is_contiguous():
            raise ValueError("C kernels need contiguous float32 CPU tensors (the AMX kernel: "
                             "float32 or bfloat16).")
        if x.dim() != 2 or x.shape[1] != self._width:
            raise ValueError(
                f"quantized linear: the weight blocks do not match x's width (x is "
                f"{tuple(x.shape)}, the weight takes [rows, {self._width}])."
            )
        out = torch.empty((x.shape[0], self._num_out), dtype=x.dtype)
        if i8:
            status = self._i8(out.data_ptr(), x.data_ptr(), x.shape[0], self._width,
                              self._num_out, self.i8_weight().data_ptr(),
                              int(self._qs.dtype == torch.uint8))  # Q4_1 (check_weight)
            if status == 2:
                raise MemoryError("quantized linear could not allocate its scratch buffer.")
            if status != 0:
                raise ValueError(f"the 8-bit quantized kernel failed (status {status}).")
            return out
        kernel = (self._amx_bf16 if bf16 else self._amx if amx else self._dp if dp
                  else self._dp_panels if dp_panels
                  else self._many if panels else self._few)
        status = kernel(
            out.data_ptr(), x.data_ptr(), x.shape[0], self._width, self._num_out,
            self._qs.data_ptr(), self._scales.data_ptr(),
        )
        if status == 3:
            raise RuntimeError("the AMX quantized kernel is not available on this level/CPU.")
        if status == 2:
            raise MemoryError("quantized linear could not allocate its scratch buffer.")
        if status != 0:
            raise ValueError(f"quantized linear needs a multiple of {QuantLinearOps.PANEL} "
                             "output rows.")
        return out


def check_weight(kind: str, qs: torch.Tensor, scales: torch.Tensor) -> int:
    """A weight's blocks in quant_linear.c's layout (Q4_1: qs uint8 [out, in / 2], scales
    float32 [out, in / 32, 2]; Q8_0: qs int8 [out, in], scales float32 [out, in / 32]);
    returns its width `in`."""
    check_f32(scales)
    width = scales.shape[1] * BLOCK
    q4_1 = kind == "Q4_1"
    num_out = qs.shape[0]
    if (
        kind not in ("Q4_1", "Q8_0")
        or qs.dtype != (torch.uint8 if q4_1 else torch.int8)
        or not qs.is_contiguous()
        or tuple(qs.shape) != (num_out, width // 2 if q4_1 else width)
        or scales.shape[0] != num_out
        or scales[0].numel() != width // BLOCK * (2 if q4_1 else 1)
    ):
        raise ValueError("quantized linear: the weight blocks do not match x's width.")
    return width


def load(isa: str | None = None) -> QuantLinearOps | None:
    """The operators built for `isa` (default: the selected level, build.select_isa)."""
    return _load(build.selected_isa() if isa is None else isa)


@functools.cache
def _load(isa: str) -> QuantLinearOps | None:
    library = build.load("quant_linear", isa)
    return None if library is None else QuantLinearOps(library)
