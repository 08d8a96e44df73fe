"""Small C kernels for the CPU path, compiled on the machine that runs them.

The C sources are in csrc/ beside this file: paged decode attention (paged_attention.c),
the fused element-wise operators of a layer (layer_ops.c), products with GGUF-quantized
weights (quant_linear.c), and a whole decoder layer of a few-row decode step built from those
three (decode_layer.c). The first use compiles each one with the system C
compiler (`$CC`, else `cc`) into the cache directory, keyed by the source, the flags, the
compiler and the CPU, so a changed source, compiler or machine gets a fresh build;
`scripts/install.sh` builds them ahead of time (`python -m tokenserve.kernels`).
The kernels are loaded with ctypes, which releases the GIL around each call, and use the
OpenMP runtime torch has already loaded (libgomp is shared by soname), so they run on the
same threads as torch's own operators.

Without a compiler, or with `TOKENSERVE_DISABLE_C_KERNELS=1`, `paged_attention()`,
`layer_ops()`, `quant_linear()` and `decode_layer()` return None and callers fall back to
pure-torch code (slower, same results up to float rounding).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import torch

from tokenserve.cache_dir import cache_root

logger = logging.getLogger(__name__)

DISABLE_ENV = "TOKENSERVE_DISABLE_C_KERNELS"
_SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
KERNELS = ("paged_attention", "layer_ops", "quant_linear", "decode_layer")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]


class KernelBuildError(RuntimeError):
    pass


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo") as file:
            lines = [line for line in file if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def build(name: str) -> str:
    """Compile `name`.c into the cache (if not there yet); returns the shared library's path."""
    compiler = _compiler()
    if compiler is None:
        raise KernelBuildError(f"no C compiler found (looked for {os.environ.get('CC', 'cc')!r})")
    source_path = os.path.join(_SOURCE_DIR, f"{name}.c")
    sources = []  # every source the kernel may include (decode_layer.c includes the others)
    for file_name in sorted(os.listdir(_SOURCE_DIR)):
        if file_name.endswith((".c", ".h")):
            with open(os.path.join(_SOURCE_DIR, file_name), "rb") as file:
                sources.append(file_name.encode() + b"\0" + file.read())
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    key = hashlib.sha256(
        b"\0".join([*sources, " ".join(_FLAGS).encode(), version.encode(), _cpu_identity().encode()])
    ).hexdigest()[:16]
    directory = os.path.join(cache_root(), "kernels")
    library = os.path.join(directory, f"{name}-{key}.so")
    if os.path.exists(library):
        return library
    os.makedirs(directory, exist_ok=True)
    # Compile to a private name and rename into place: a racing process never loads a
    # half-written library.
    handle, partial = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=directory)
    os.close(handle)
    try:
        result = subprocess.run(
            [compiler, *_FLAGS, source_path, "-o", partial, "-lm"],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise KernelBuildError(f"{compiler} failed on {name}.c:\n{result.stderr.strip()}")
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return library


@functools.cache
def _load(name: str) -> ctypes.CDLL | None:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    try:
        return ctypes.CDLL(build(name))
    except (OSError, KernelBuildError) as error:
        logger.warning("C kernel %r unavailable, using the pure-torch path: %s", name, error)
        return None


_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


class PagedAttentionOps:
    """The kernels of paged_attention.c over torch tensors (see there for layouts)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._decode = library.ts_paged_decode
        self._decode.restype = ctypes.c_int
        self._decode.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr,
                                 _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64]
        self._write_kv = library.ts_write_kv
        self._write_kv.restype = None
        self._write_kv.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64,
                                   _i64]

    def decode(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        rows: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> None:
        """Attend query rows `rows` of query [tokens, heads, dim] (a view into a fused QKV
        tensor is fine) over their contexts; write the same rows of out [tokens, heads, dim].
        The caches are float32 or bfloat16."""
        self.decode_prepared(out, query, key_cache, value_cache,
                             DecodeRows(rows, block_tables, seq_lens), scale)

    def decode_prepared(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        decode_rows: DecodeRows,
        scale: float,
    ) -> None:
        """decode() with the step's rows, block tables and lengths checked beforehand, once
        for all layers."""
        bf16 = _check_caches(key_cache, value_cache)
        _check_rows(out, query)
        _, num_heads, head_dim = query.shape
        _, num_kv_heads, block_size, _ = key_cache.shape
        status = self._decode(
            out.data_ptr(), out.stride(0), query.data_ptr(), query.stride(0),
            decode_rows.rows.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            decode_rows.block_tables.data_ptr(), decode_rows.block_tables.stride(0),
            decode_rows.seq_lens.data_ptr(), decode_rows.num_rows, num_heads, num_kv_heads,
            head_dim, block_size, scale, bf16,
        )
        if status != 0:
            raise MemoryError("paged decode could not allocate its scratch buffers.")

    def write_kv(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """key/value [tokens, kv_heads, dim] (views into a fused QKV tensor are fine) into
        slots [tokens] of the caches [blocks, kv_heads, block_size, dim] (float32, or
        bfloat16: rounded to nearest even)."""
        bf16 = _check_caches(key_cache, value_cache)
        _check_rows(key, value)
        _check_i64(slots)
        if key.stride(0) != value.stride(0) and len(slots) > 1:
            raise ValueError("write_kv needs key and value with the same row stride.")
        _, num_kv_heads, block_size, head_dim = key_cache.shape
        if key.shape[1:] != (num_kv_heads, head_dim) or len(slots) != key.shape[0]:
            raise ValueError("write_kv: shapes of key, slots and cache disagree.")
        self._write_kv(
            key_cache.data_ptr(), value_cache.data_ptr(), key.data_ptr(), value.data_ptr(),
            key.stride(0), slots.data_ptr(), len(slots), num_kv_heads, block_size, head_dim,
            bf16,
        )


class DecodeRows:
    """A step's decode rows for the paged decode kernel: the rows' indices in the step's
    tokens, their block tables [rows, stride] and context lengths, all int64, checked once
    and then used by every layer."""

    __slots__ = ("block_tables", "num_rows", "rows", "seq_lens")

    def __init__(self, rows: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor) -> None:
        _check_i64(rows, block_tables, seq_lens)
        if not rows.shape[0] == seq_lens.shape[0] == block_tables.shape[0]:
            raise ValueError("paged decode: rows, seq_lens and block_tables disagree in length.")
        self.rows, self.block_tables, self.seq_lens = rows, block_tables, seq_lens
        self.num_rows = rows.shape[0]


def _check_rows(*tensors: torch.Tensor) -> None:
    """[rows, heads, dim] float32 with rows at any stride and each row's heads contiguous."""
    for tensor in tensors:
        rows, heads, dim = tensor.shape
        if (
            tensor.dtype != torch.float32
            or not tensor.is_cpu
            or tensor.stride(2) != 1
            or (heads > 1 and tensor.stride(1) != dim)
        ):
            raise ValueError("C kernels need float32 CPU tensors with contiguous heads.")


def _check_i64(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.dtype != torch.int64 or not tensor.is_contiguous() or not tensor.is_cpu:
            raise ValueError("C kernels need contiguous int64 CPU index tensors.")


@functools.cache
def paged_attention() -> PagedAttentionOps | None:
    library = _load("paged_attention")
    return None if library is None else PagedAttentionOps(library)


class LayerOps:
    """The fused operators of layer_ops.c over torch tensors (fp32, contiguous)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._rms_norm = library.ts_rms_norm_f32
        self._rms_norm.restype = None
        self._rms_norm.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float]
        self._silu_and_mul = library.ts_silu_and_mul_f32
        self._silu_and_mul.restype = None
        self._silu_and_mul.argtypes = [_ptr, _ptr, _i64, _i64]
        self._rotary = library.ts_rotary_f32
        self._rotary.restype = None
        self._rotary.argtypes = [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64]

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RMSNorm of x [rows, hidden]; with `residual`, of residual + x, which is also
        written back into `residual` (in place)."""
        _check_f32(x, weight, *(() if residual is None else (residual,)))
        out = torch.empty_like(x)
        self._rms_norm(
            out.data_ptr(), x.data_ptr(), 0 if residual is None else residual.data_ptr(),
            weight.data_ptr(), x.shape[0], x.shape[1], eps,
        )
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [rows, 2 * d] → [rows, d]."""
        _check_f32(gate_up)
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._silu_and_mul(out.data_ptr(), gate_up.data_ptr(), rows, width // 2)
        return out

    def rotary(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Rotate query [tokens, heads, dim] and key [tokens, kv_heads, dim] in place. Both
        may be views into one fused QKV tensor: rows may be strided (the same stride), heads
        must be contiguous within a row."""
        _check_f32(cos, sin)
        _check_rows(query, key)
        _check_i64(positions)
        tokens, heads, dim = query.shape
        if tokens > 1 and key.stride(0) != query.stride(0):
            raise ValueError("rotary needs query and key with the same row stride.")
        self._rotary(
            query.data_ptr(), key.data_ptr(), query.stride(0), positions.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), tokens, heads, key.shape[1], dim,
        )


def _check_f32(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.dtype != torch.float32 or not tensor.is_contiguous() or not tensor.is_cpu:
            raise ValueError("C kernels need contiguous float32 CPU tensors.")


def _check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    """1 for bfloat16 caches, 0 for float32; anything else is refused."""
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in (torch.float32,
                                                                       torch.bfloat16):
        raise ValueError("C kernels need float32 or bfloat16 KV caches, both the same.")
    for cache in (key_cache, value_cache):
        if not cache.is_contiguous() or not cache.is_cpu:
            raise ValueError("C kernels need contiguous CPU KV caches.")
    return int(key_cache.dtype == torch.bfloat16)


@functools.cache
def layer_ops() -> LayerOps | None:
    library = _load("layer_ops")
    return None if library is None else LayerOps(library)


class QuantLinearOps:
    """The kernels of quant_linear.c: y = x · Wᵀ with W in GGUF's Q4_1 or Q8_0 blocks,
    repacked by `model/quantized.py` (see quant_linear.c for the layouts). Two per format:
    the few-row kernel, and with `panels=True` the many-row one (output rows a multiple of
    `PANEL`)."""

    PANEL = 16

    def __init__(self, library: ctypes.CDLL) -> None:
        self._kernels = {
            ("Q4_1", False): library.ts_q4_1_linear_f32,
            ("Q8_0", False): library.ts_q8_0_linear_f32,
            ("Q4_1", True): library.ts_q4_1_gemm_f32,
            ("Q8_0", True): library.ts_q8_0_gemm_f32,
        }
        for function in self._kernels.values():
            function.restype = ctypes.c_int
            function.argtypes = [_ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr]

    def q4_1(
        self, x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor, panels: bool = False
    ) -> torch.Tensor:
        """x [M, K] float32 times W [N, K] given as qs uint8 [N, K / 2] and dm float32
        [N, K / 32, 2] → [M, N]."""
        _check_linear(x, qs, dm, qs.shape[0], torch.uint8, x.shape[1] // 2)
        return self._run("Q4_1", panels, x, qs, dm)

    def q8_0(
        self, x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, panels: bool = False
    ) -> torch.Tensor:
        """x [M, K] float32 times W [N, K] given as qs int8 [N, K] and d float32 [N, K / 32]."""
        _check_linear(x, qs, d, qs.shape[0], torch.int8, x.shape[1])
        return self._run("Q8_0", panels, x, qs, d)

    def bind(self, kind: str, qs: torch.Tensor, scales: torch.Tensor) -> BoundQuantLinear:
        """Both kernels of one weight, the weight checked once: a decode step makes ~120 of
        these products, each a few tens of µs, so per-call checks of the weight would be a
        sizeable share of them."""
        _check_weight(kind, qs, scales)
        return BoundQuantLinear(self._kernels[kind, False], self._kernels[kind, True], qs, scales)

    def _run(
        self, kind: str, panels: bool, x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor
    ) -> torch.Tensor:
        return BoundQuantLinear(self._kernels[kind, False], self._kernels[kind, True], qs,
                                scales)(x, panels)


class BoundQuantLinear:
    """y = x · Wᵀ for one checked weight (`QuantLinearOps.bind`): each call checks only x."""

    __slots__ = ("_few", "_many", "_num_out", "_qs", "_scales", "_width")

    def __init__(self, few, many, qs: torch.Tensor, scales: torch.Tensor) -> None:
        self._few, self._many = few, many
        # The tensors are held so that their memory outlives the pointers passed to C.
        self._qs, self._scales = qs, scales
        self._num_out, self._width = qs.shape[0], scales.shape[1] * 32

    def __call__(self, x: torch.Tensor, panels: bool = False) -> torch.Tensor:
        """x [M, K] float32, contiguous → [M, N]; `panels` picks the many-row kernel."""
        if x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous():
            raise ValueError("C kernels need contiguous float32 CPU tensors.")
        if x.dim() != 2 or x.shape[1] != self._width:
            raise ValueError(
                f"quantized linear: the weight blocks do not match x's width (x is "
                f"{tuple(x.shape)}, the weight takes [rows, {self._width}])."
            )
        out = torch.empty((x.shape[0], self._num_out), dtype=torch.float32)
        status = (self._many if panels else self._few)(
            out.data_ptr(), x.data_ptr(), x.shape[0], self._width, self._num_out,
            self._qs.data_ptr(), self._scales.data_ptr(),
        )
        if status == 2:
            raise MemoryError("quantized linear could not allocate its scratch buffer.")
        if status != 0:
            raise ValueError(f"quantized linear needs a multiple of {QuantLinearOps.PANEL} "
                             "output rows.")
        return out


def _check_linear(
    x: torch.Tensor,
    qs: torch.Tensor,
    scales: torch.Tensor,
    num_out: int,
    qs_dtype: torch.dtype,
    qs_width: int,
) -> None:
    _check_f32(x, scales)
    if x.dim() != 2 or x.shape[1] % 32 != 0:
        raise ValueError("quantized linear needs x [rows, K] with K a multiple of 32.")
    if (
        qs.dtype != qs_dtype
        or not qs.is_contiguous()
        or tuple(qs.shape) != (num_out, qs_width)
        or scales.shape[0] != num_out
        or scales[0].numel() != x.shape[1] // 32 * (2 if qs_dtype == torch.uint8 else 1)
    ):
        raise ValueError("quantized linear: the weight blocks do not match x's width.")


def _check_weight(kind: str, qs: torch.Tensor, scales: torch.Tensor) -> int:
    """_check_linear for a weight alone (any x of its width); returns that width."""
    width = scales.shape[1] * 32
    q4_1 = kind == "Q4_1"
    _check_linear(torch.empty(0, width), qs, scales, qs.shape[0],
                  torch.uint8 if q4_1 else torch.int8, width // 2 if q4_1 else width)
    return width


@functools.cache
def quant_linear() -> QuantLinearOps | None:
    library = _load("quant_linear")
    return None if library is None else QuantLinearOps(library)


class _Projection(ctypes.Structure):
    _fields_ = [("qs", _ptr), ("scales", _ptr), ("bias", _ptr), ("out", _i64), ("inp", _i64),
                ("q4_1", _i64), ("few_rows", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection),
                ("down", _Projection), ("input_norm", _ptr), ("post_norm", _ptr),
                ("key_cache", _ptr), ("value_cache", _ptr)]


class _Step(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in (
            "num_rows", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
            "block_size", "kv_bf16", "block_table_stride", "max_seq_len")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        *((name, _ptr) for name in (
            "positions", "slots", "block_tables", "seq_lens", "cos", "sin", "normed", "qkv",
            "attn", "o", "gate_up", "act")),
    ]


class DecodeLayerOps:
    """decode_layer.c: a whole Llama decoder layer of a decode step of few rows in one call.
    `layer()` checks and binds a layer's tensors once; `step()` a step's shared tensors (and
    allocates its scratch buffers) once for all layers; `run()` then only passes pointers."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._run = library.ts_decode_layer
        self._run.restype = ctypes.c_int
        self._run.argtypes = [ctypes.POINTER(_Layer), ctypes.POINTER(_Step), _ptr, _ptr, _i64,
                              _ptr]

    def layer(
        self,
        projections: dict[str, tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]],
        input_norm: torch.Tensor,
        post_norm: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> tuple[_Layer, tuple]:
        """projections: "qkv", "o", "gate_up", "down" → (GGUF kind, qs, scales, bias or
        None, few_rows: the most rows for the few-row kernel, the many-row one above), in
        quant_linear.c's layouts. Returns the bound layer and the tensors it points into
        (keep them alive as long as the layer)."""
        _check_caches(key_cache, value_cache)
        _check_f32(input_norm, post_norm)
        parts = {}
        for name, (kind, qs, scales, bias, few_rows) in projections.items():
            width = _check_weight(kind, qs, scales)
            if bias is not None:
                _check_f32(bias)
            parts[name] = _Projection(qs.data_ptr(), scales.data_ptr(),
                                      None if bias is None else bias.data_ptr(), qs.shape[0],
                                      width, int(kind == "Q4_1"), few_rows)
        bound = _Layer(parts["qkv"], parts["o"], parts["gate_up"], parts["down"],
                       input_norm.data_ptr(), post_norm.data_ptr(), key_cache.data_ptr(),
                       value_cache.data_ptr())
        return bound, (projections, input_norm, post_norm, key_cache, value_cache)

    def step(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        hidden: int,
        intermediate: int,
        eps: float,
        scale: float,
        positions: torch.Tensor,
        slots: torch.Tensor,
        decode_rows: DecodeRows,
        cos: torch.Tensor,
        sin: torch.Tensor,
        block_size: int,
        kv_bf16: bool,
    ) -> tuple[_Step, tuple]:
        """The step's shared arguments; decode row r must be token r of the step. Returns the
        bound step and the tensors it points into (keep them alive for the step)."""
        rows = decode_rows.num_rows
        _check_i64(positions, slots)
        _check_f32(cos, sin)
        if positions.shape[0] != rows or slots.shape[0] != rows:
            raise ValueError("decode layer: positions and slots need one entry per row.")
        scratch = [torch.empty(rows, width) for width in (
            hidden, (num_heads + 2 * num_kv_heads) * head_dim, num_heads * head_dim, hidden,
            2 * intermediate, intermediate)]
        bound = _Step(
            rows, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size,
            int(kv_bf16), decode_rows.block_tables.stride(0),
            int(decode_rows.seq_lens.max()), eps, scale, positions.data_ptr(),
            slots.data_ptr(), decode_rows.block_tables.data_ptr(),
            decode_rows.seq_lens.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            *(buffer.data_ptr() for buffer in scratch),
        )
        return bound, (positions, slots, decode_rows, cos, sin, scratch)

    def run(self, layer: _Layer, step: _Step, hidden: torch.Tensor, residual: torch.Tensor,
            add_input: bool, out: torch.Tensor) -> None:
        """out = the layer on hidden (all [rows, hidden_size], contiguous float32; residual
        updated in place; for the first layer add_input=False and residual is hidden)."""
        status = self._run(ctypes.byref(layer), ctypes.byref(step), hidden.data_ptr(),
                           residual.data_ptr(), int(add_input), out.data_ptr())
        if status == 1:
            raise ValueError("decode layer: the weights' shapes do not fit the step's.")
        if status != 0:
            raise MemoryError("decode layer could not allocate its scratch buffers.")


@functools.cache
def decode_layer() -> DecodeLayerOps | None:
    library = _load("decode_layer")
    return None if library is None else DecodeLayerOps(library)
