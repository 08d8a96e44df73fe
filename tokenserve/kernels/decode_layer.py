"""Bindings of csrc/decode_layer.c: a whole Llama decoder layer of a step of few rows (decode
rows and prompt chunks) in one call (model/fused_decode.py runs the layers through it)."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenserve.kernels import build
from tokenserve.kernels.paged_attention import DecodeRows, prefetch_code
from tokenserve.kernels.prompt_attention import PromptChunks
from tokenserve.kernels.quant_linear import check_weight
from tokenserve.kernels.tensor_checks import check_caches, check_f32, check_i64, i64, ptr


class _Projection(ctypes.Structure):
    _fields_ = [("qs", ptr), ("scales", ptr), ("bias", ptr), ("out", i64), ("inp", i64),
                ("q4_1", i64), ("few_rows", i64), ("amx", i64), ("dp", i64), ("i8", i64),
                ("i8_weight", ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection),
                ("down", _Projection), ("input_norm", ptr), ("post_norm", ptr),
                ("key_cache", ptr), ("value_cache", ptr)]


class _Step(ctypes.Structure):
    _fields_ = [
        *((name, i64) for name in (
            "num_rows", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
            "block_size", "kv_mode", "block_table_stride", "max_seq_len")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        *((name, ptr) for name in (
            "positions", "slots", "block_tables", "seq_lens", "cos", "sin", "normed", "qkv",
            "attn", "o", "gate_up", "act", "decode_rows")),
        ("num_decode_rows", i64), ("chunks", ptr), ("chunk_tables", ptr),
        *((name, i64) for name in (
            "num_chunks", "chunk_table_stride", "prompt_kv", "decode_prefetch", "prefix_len",
            "prefix_rows")),
        *((name, ptr) for name in ("prefix_out", "prefix_lse", "suffix_lse")),
        ("split_decode", i64),
    ]


class DecodeLayerOps:
    """decode_layer.c: the Llama decoder layers of a step of few rows in one call.
    `layer()` checks and binds a layer's tensors once, `stack()` the bound layers into one
    array; `step()` a step's shared tensors (and allocates its scratch buffers) once for all
    layers; `run_layers()` then only passes pointers."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._run_all = library.ts_decode_layers
        self._run_all.restype = ctypes.c_int
        self._run_all.argtypes = [ctypes.POINTER(ctypes.POINTER(_Layer)), i64,
                                  ctypes.POINTER(_Step), ptr, ptr, ptr, ptr,
                                  ctypes.POINTER(i64)]

    def layer(
        self,
        projections: dict[str, tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]],
        input_norm: torch.Tensor,
        post_norm: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> tuple[_Layer, tuple]:
        """projections: "qkv", "o", "gate_up", "down" → (GGUF kind, qs, scales, bias or
        None, few_rows: the most rows for the few-row kernel, the many-row one above, amx:
        the AMX kernel above instead, dp: the vdpbf16ps one above instead, both bf16
        numerics, i8: the most rows for the kernel of x rounded to 8 bits, ahead of all
        those, i8_weight: the weight in that kernel's layout or None), in quant_linear.c's
        layouts. Returns
        the bound layer and the tensors it points into (keep them alive as long as the
        layer)."""
        check_caches(key_cache, value_cache)
        check_f32(input_norm, post_norm)
        parts = {}
        for name, (kind, qs, scales, bias, few_rows, amx, dp, i8, i8_weight) in (
                projections.items()):
            width = check_weight(kind, qs, scales)
            if bias is not None:
                check_f32(bias)
            if i8 and (i8_weight is None or i8_weight.dtype != torch.uint8):
                raise ValueError("the 8-bit kernel's rows need the weight in its layout "
                                 "(QuantLinearOps.repack_i8).")
            parts[name] = _Projection(qs.data_ptr(), scales.data_ptr(),
                                      None if bias is None else bias.data_ptr(), qs.shape[0],
                                      width, int(kind == "Q4_1"), few_rows, int(amx),
                                      int(dp), i8,
                                      None if i8_weight is None else i8_weight.data_ptr())
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
        decode_rows: DecodeRows | None,
        prompt_chunks: PromptChunks | None = None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        block_size: int,
        num_blocks: int,
        kv_mode: int,
        decode_prefetch: str | None = None,
        split_decode: bool = True,
    ) -> tuple[_Step, tuple]:
        """The step's shared arguments: one position and cache slot per row of the step;
        its decode rows (the paged decode kernel's, in kv_mode, prefetching as
        decode_prefetch says: paged_attention.DECODE_PREFETCH, None for this CPU's plan) and
        its prompt chunks (the prompt-attention kernel's, over caches of num_blocks blocks),
        either may be None, between them every row once. split_decode: when the decode
        rows' attention items are few and do not share out evenly over the threads, each
        row's context is attended to in two halves, merged by their log-sum-exps (the sums
        then depend on the step's other rows: False where outputs must not).
        Returns the bound step and the tensors it points into (keep them alive for the
        step)."""
        rows = positions.shape[0]
        check_i64(positions, slots)
        check_f32(cos, sin)
        if slots.shape[0] != rows:
            raise ValueError("decode layer: positions and slots need one entry per row.")
        num_decode = 0 if decode_rows is None else decode_rows.num_rows
        num_prompt = 0 if prompt_chunks is None else prompt_chunks.num_rows
        if num_decode + num_prompt != rows or (
            num_decode and not bool(((decode_rows.rows >= 0) & (decode_rows.rows < rows)).all())
        ) or (prompt_chunks is not None and prompt_chunks.num_tokens > rows):
            raise ValueError("decode layer: the decode rows and prompt chunks must cover the "
                             "step's rows once.")
        if prompt_chunks is not None:
            prompt_chunks.check_cache(block_size, num_blocks)
        scratch = [torch.empty(rows, width) for width in (
            hidden, (num_heads + 2 * num_kv_heads) * head_dim, num_heads * head_dim, hidden,
            2 * intermediate, intermediate)]
        decode = decode_rows if num_decode else None
        chunks = prompt_chunks if prompt_chunks is not None and prompt_chunks.num_chunks else None
        # The shared prefix's buffers: its half of the rows' attention, both halves'
        # log-sum-exps.
        prefix_len = 0 if decode is None else decode.prefix_len
        prefix_rows = decode.prefix_rows if prefix_len else 0
        prefix = [torch.empty(prefix_rows, width) for width in (
            num_heads * head_dim, num_heads, num_heads)] if prefix_len else [None] * 3
        bound = _Step(
            rows, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size,
            kv_mode, 0 if decode is None else decode.block_tables.stride(0),
            0 if decode is None else int(decode.seq_lens.max()), eps, scale,
            positions.data_ptr(), slots.data_ptr(),
            None if decode is None else decode.block_tables.data_ptr(),
            None if decode is None else decode.seq_lens.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), *(buffer.data_ptr() for buffer in scratch),
            None if decode is None else decode.rows.data_ptr(), num_decode,
            None if chunks is None else chunks.chunks.data_ptr(),
            None if chunks is None else chunks.block_tables.data_ptr(),
            0 if chunks is None else chunks.num_chunks,
            0 if chunks is None else chunks.block_tables.stride(0),
            # The prompt kernel's cache mode: what the cache holds (2 is a bf16 cache too).
            1 if kv_mode == 2 else kv_mode, prefetch_code(decode_prefetch), prefix_len,
            prefix_rows,
            *(None if buffer is None else buffer.data_ptr() for buffer in prefix),
            int(split_decode),
        )
        return bound, (positions, slots, decode_rows, prompt_chunks, cos, sin, scratch, prefix)

    @staticmethod
    def stack(layers: list[_Layer]) -> ctypes.Array:
        """The layers' pointers as `run_layers` takes them (the array does not keep the
        layers alive: hold them as long as it is used)."""
        return (ctypes.POINTER(_Layer) * len(layers))(*(ctypes.pointer(l) for l in layers))

    def run_layers(self, stack: ctypes.Array, step: _Step, hidden: torch.Tensor,
                   residual: torch.Tensor, out: torch.Tensor, spare: torch.Tensor
                   ) -> torch.Tensor:
        """The stacked layers in turn on hidden, the residual stream itself (all [rows,
        hidden_size], contiguous float32; residual updated in place), each layer's output
        the next one's input; `out` and `spare` take the layers' outputs by turns. Returns
        the last layer's output (one of them)."""
        if not len(stack):
            return hidden
        last = i64(0)
        status = self._run_all(stack, len(stack), ctypes.byref(step), hidden.data_ptr(),
                               residual.data_ptr(), out.data_ptr(), spare.data_ptr(),
                               ctypes.byref(last))
        _check_status(status)
        return spare if last.value else out


def _check_status(status: int) -> None:
    if status == 1:
        raise ValueError("decode layer: the weights' shapes do not fit the step's.")
    if status != 0:
        raise MemoryError("decode layer could not allocate its scratch buffers.")


def load(isa: str | None = None) -> DecodeLayerOps | None:
    """The operators built for `isa` (default: the selected level, build.select_isa)."""
    return _load(build.selected_isa() if isa is None else isa)


@functools.cache
def _load(isa: str) -> DecodeLayerOps | None:
    library = build.load("decode_layer", isa)
    return None if library is None else DecodeLayerOps(library)
