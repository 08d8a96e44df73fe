"""Paged attention on CPU: C kernels for prompt chunks attending in bf16 or over a float32
cache and for decode rows, PyTorch's scaled_dot_product_attention for the other prompt
chunks.

Prompt chunks that attend in bf16 (see the last paragraph) go, where the prompt-attention
kernel (kernels/prompt_attention.py) runs them on a path faster than SDPA on this CPU
(prompt_kernel_paths: AMX tiles, or vdpbf16ps where the CPU has no AMX), all
of them, first and continuing alike and those sharing a long prefix too (no cascade: on
W3's shape the kernel attending each chunk alone took ~0.75 of cascade's time,
docs/PERFORMANCE_CPU.md), to one call of that kernel per layer: after the
step's keys and values are written, it reads each chunk's queries in place from the fused
QKV tensor and its context from the blocks (no gather, no mask, no casts), causal aligned
bottom-right, with the numerics of PyTorch's bf16 flash kernel
(docs/PERFORMANCE_CPU.md). Its chunk table (`PromptChunks`) is built once per step in
`build_metadata`. Over a float32 cache (a float32 model: `--dtype auto` on a CPU without
native bf16) the kernel's float32 path takes them the same way, in float32, on every level
(docs/PERFORMANCE_CPU.md, "The float32 path"). Elsewhere (a bf16 or 8-bit float cache
under float32 attention, the vdpbf16ps path on an AMX CPU forced to a lower --cpu-isa, the
kernels off) each
prompt chunk gets its own SDPA call (4-D, so PyTorch takes its flash kernel, GQA
included). A chunk with nothing cached before it attends over its own new keys and values
directly; a chunk that continues a context gathers that context once per layer and uses a
causal mask offset by the tokens already cached. Several tokens of a running request (a
multi-token step) are such a continuing chunk. On that path, chunks that continue contexts
sharing at least CASCADE_MIN_PREFIX_TOKENS cached tokens take cascade attention
(attention/cascade.py), from where it pays (benchmarks/cascade_attention.py,
docs/benchmarks/cpu-hot-path.md); `--disable-cascade-attn` turns it off.

Decode rows (one query token) of all requests go to the paged-decode C kernel
(kernels/paged_attention.py), which reads each query in place from the fused QKV tensor
and each context in place from its blocks, and writes its rows of the output; a second
kernel writes the step's new keys and values into their slots. Where the kernels are off,
decode rows are attended in one padded SDPA call over gathered contexts instead (the same
results, more memory traffic). Index tensors are built once per step, in `build_metadata`.
Where at least DECODE_PREFIX_MIN_ROWS decode rows start with the same cached blocks
(DECODE_PREFIX_MIN_TOKENS positions or more), `DecodeRows.prefix_len` and `prefix_rows` say
so (those rows first), and the prompt kernel attends to that prefix for them at once and to
the rest of each context row by row, merged (`decode_shared_prefix`; the fused decode layer
likewise; on AMX, else whole contexts); `--disable-cascade-attn` turns it off too.

A layer's cache is [2, num_blocks, num_kv_heads, block_size, head_dim], keys then values: a
kv head's keys within a block are contiguous, which is what the decode kernel streams. A
token's slot is block * block_size + offset; a gather indexes [blocks, :, offsets]. The
cache may hold a narrower dtype than the model (--kv-cache-dtype bfloat16, or fp8: 8-bit
floats): keys and values are rounded as they are written and widened as they are read. A
first chunk attends to its keys and values as computed (over an 8-bit float cache, as the
cache holds them: see below); a chunk that continues a context reads all of it from the
cache, its own new tokens included.

Prompt chunks attend in the cache's dtype when that is bfloat16 and the CPU computes bf16
natively (`prompt_dtype`): their keys and values are then exactly what the cache holds and
what decode reads, and SDPA's bf16 kernel (AMX tiles) runs about three times as fast as
float32 (docs/PERFORMANCE_CPU.md); queries are rounded to bf16, the softmax and the sums stay
float32 inside the kernel, and the output is widened back. Over an 8-bit float cache they
attend in bf16 there too (every 8-bit float is a bf16 exactly): on the prompt kernel where it
takes a bf16 cache's chunks (head sizes of 32s), else on SDPA, a first chunk then over its
keys and values rounded as the cache holds them, so that every path attends to what decode
reads; decode rows widen the cache's values to float32 in the decode kernel (and take the
shared-prefix path as over a bf16 cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tokenserve.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    CommonAttentionMetadata,
)
from tokenserve.attention.cascade import Cascade, attend_cascade, plan_cascades
from tokenserve.attention.paged_context import context_index, gather_context, offset_causal_mask
from tokenserve.kernels import build, cpu_isa, paged_attention, prompt_attention
from tokenserve.kernels.paged_attention import DecodeRows, round_to_cache, shared_prefix_rows
from tokenserve.kernels.prompt_attention import PromptChunks
from tokenserve.kernels.row_buckets import empty_rows

# The shortest shared prefix that cascade attention takes (see the module docstring).
CASCADE_MIN_PREFIX_TOKENS = 1024
# Decode rows whose contexts start with the same cached blocks: from how many rows and
# positions the C kernels attend to those blocks for all of them at once
# (DecodeRows.prefix_len; docs/PERFORMANCE_CPU.md, "Decode rows over a shared prefix").
DECODE_PREFIX_MIN_ROWS = 8
DECODE_PREFIX_MIN_TOKENS = 256


def prompt_kernel_paths(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The prompt-attention kernel's paths the backend takes on a CPU with `flags` (default:
    this one): those measured faster than SDPA (benchmarks/prompt_attention.py,
    docs/PERFORMANCE_CPU.md). AMX tiles: 1.2-1.5x on W3/W4 chunks. The vdpbf16ps path only
    on a CPU without AMX, where SDPA's GEMMs have none either: 2.2-3.7x there (AMD EPYC,
    Zen 4); on an AMX CPU it ran at 0.4-0.9x of SDPA, whose GEMMs there are oneDNN's AMX
    ones whatever --cpu-isa selects. The float32 path everywhere: 1.1-2x SDPA's float32
    flash kernel on an AVX2 CPU (AMD EPYC, Zen 3), not measured on AVX-512."""
    flags = cpu_isa.cpu_flags() if flags is None else flags
    bf16 = ("amx",) if "amx_bf16" in flags else ("amx", "avx512_bf16")
    return (*bf16, "float32")


@dataclass
class PromptChunk:
    """Rows start:end of the step: one request's queries, attended by one SDPA call."""

    start: int
    end: int
    # The blocks and length of the context the chunk continues; None for a first chunk,
    # which attends over its own keys and values alone (causal).
    context: tuple[torch.Tensor, int] | None = None
    # [query_len, context_len] bool with a context: built at the first SDPA call that needs
    # it (a step whose chunks all go to the C kernel builds none).
    mask: torch.Tensor | None = None

    def causal_mask(self, device: torch.device) -> torch.Tensor | None:
        """None for a first chunk (SDPA's is_causal); else the mask offset by the context."""
        if self.context is not None and self.mask is None:
            self.mask = offset_causal_mask(self.context[1], self.end - self.start, device)
        return self.mask


@dataclass
class PaddedDecode:
    """Decode rows without the C kernels: every context gathered, padded to the longest."""

    blocks: torch.Tensor  # [rows, max_len]: each context token's block ...
    offsets: torch.Tensor  # ... and offset in it (padding: block 0's first slot)
    mask: torch.Tensor  # [rows, 1, 1, max_len] bool: the real tokens


@dataclass
class TorchSDPAMetadata(AttentionMetadata):
    prompt_chunks: list[PromptChunk] = field(default_factory=list)
    cascades: list[Cascade] = field(default_factory=list)
    # Rows with one query token each (a decode row), in the step's token order.
    decode_rows: torch.Tensor | None = None
    # With the C kernels: the decode rows, block tables and context lengths, checked once.
    decode_batch: DecodeRows | None = None
    # Without them: the padded gather of the decode rows' contexts, and where each new
    # token's key and value go ((block, offset) per token).
    padded_decode: PaddedDecode | None = None
    # With the C kernels: prompt_chunks as the prompt-attention kernel's chunk table.
    prompt_batch: PromptChunks | None = None
    write_index: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_decode_rows(self) -> int:
        return 0 if self.decode_rows is None else len(self.decode_rows)

    @property
    def is_decode_only(self) -> bool:
        """Every token of the step a decode row (no prompt chunk, no cascade)."""
        return self.num_decode_rows == self.num_tokens


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def __init__(
        self,
        use_kernels: bool = True,
        cascade: bool = True,
        device: torch.device | None = None,
        cascade_min_prefix_tokens: int = CASCADE_MIN_PREFIX_TOKENS,
        native_bf16: bool | None = None,
        split_decode: bool = True,
    ) -> None:
        self.ops = paged_attention.load() if use_kernels else None
        # Whether the decode kernel may attend to a few rows' contexts in two halves on the
        # threads (csrc/paged_attention.c, DecodeSplit): not where a row's outputs must not
        # depend on its batch (`--batch-invariant`).
        self.split_decode = split_decode
        self.prompt_ops = prompt_attention.load() if use_kernels else None
        # The prompt kernel's paths taken (benchmarks/prompt_attention.py sets all of them).
        self.prompt_paths = prompt_kernel_paths()
        # Whether a bf16 cache's prompt chunks attend in bf16 (default: the kernels' level has
        # native bf16, cpu_isa.native_bf16).
        self.native_bf16 = (
            cpu_isa.native_bf16(build.selected_isa()) if native_bf16 is None else native_bf16
        )
        self.cascade = cascade and hasattr(
            torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"
        )
        self.cascade_min_prefix_tokens = cascade_min_prefix_tokens
        self.device = device or torch.device("cpu")

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    def kv_cache_block_dim(self) -> int:
        return 1

    @staticmethod
    def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's cache as its key and value caches, each contiguous
        [num_blocks, num_kv_heads, block_size, head_dim]."""
        return kv_cache[0], kv_cache[1]

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        device = self.device
        metadata = TorchSDPAMetadata(slot_mapping=common.slot_mapping, num_tokens=common.num_tokens)
        decode_reqs: list[int] = []
        continuing: list[int] = []  # requests whose chunk continues a cached context
        for i in range(common.num_reqs):
            start, end = common.query_start_loc[i], common.query_start_loc[i + 1]
            if end - start == 1:
                decode_reqs.append(i)
            elif common.seq_lens[i] == end - start:
                # Nothing cached before this chunk: its own keys are the whole context.
                metadata.prompt_chunks.append(PromptChunk(start, end))
            else:
                continuing.append(i)
        alone = continuing
        if self.cascade:
            metadata.cascades, alone = plan_cascades(
                common, continuing, self.cascade_min_prefix_tokens, device
            )
        for i in alone:
            start, end = common.query_start_loc[i], common.query_start_loc[i + 1]
            seq_len = common.seq_lens[i]
            num_blocks = -(-seq_len // common.block_size)
            blocks = torch.tensor(common.block_tables[i][:num_blocks], device=device)
            metadata.prompt_chunks.append(PromptChunk(start, end, (blocks, seq_len)))

        if self.prompt_ops is not None and (metadata.prompt_chunks or continuing):
            # Every prompt chunk, those of cascades included: where the kernel takes the
            # step's chunks it takes them all, and no cascade runs.
            spans = [(chunk.start, chunk.end) for chunk in metadata.prompt_chunks if
                     chunk.context is None]
            spans += [(common.query_start_loc[i], common.query_start_loc[i + 1])
                      for i in continuing]
            metadata.prompt_batch = self._prompt_batch(common, spans)
        if self.ops is None:
            slots = common.slot_mapping
            metadata.write_index = (slots // common.block_size, slots % common.block_size)
        if decode_reqs:
            metadata.decode_rows = torch.tensor(
                [common.query_start_loc[i] for i in decode_reqs], device=device
            )
            seq_lens = [common.seq_lens[i] for i in decode_reqs]
            if self.ops is not None:
                metadata.decode_batch = self._decode_batch(common, decode_reqs, seq_lens,
                                                           metadata.decode_rows)
            else:
                metadata.padded_decode = self._padded_decode(common, decode_reqs, seq_lens)
        return metadata

    def _decode_batch(
        self,
        common: CommonAttentionMetadata,
        decode_reqs: list[int],
        seq_lens: list[int],
        rows: torch.Tensor,
    ) -> DecodeRows:
        block_size = common.block_size
        num_blocks = max(-(-n // block_size) for n in seq_lens)
        tables = np.zeros((len(decode_reqs), num_blocks), dtype=np.int64)
        for row, i in enumerate(decode_reqs):
            used = -(-seq_lens[row] // block_size)
            tables[row, :used] = common.block_tables[i][:used]
        lengths = np.asarray(seq_lens, dtype=np.int64)
        shared, prefix_len = (shared_prefix_rows(tables, seq_lens, block_size,
                                                 DECODE_PREFIX_MIN_ROWS,
                                                 DECODE_PREFIX_MIN_TOKENS)
                              if self.cascade else (None, 0))
        if prefix_len:
            # The rows sharing the prefix first (DecodeRows.prefix_rows); each row's output
            # still goes to its own token's place.
            order = np.concatenate([shared, np.setdiff1d(np.arange(len(seq_lens)), shared)])
            rows, tables, lengths = rows[torch.from_numpy(order)], tables[order], lengths[order]
        return DecodeRows(
            rows,
            torch.from_numpy(np.ascontiguousarray(tables)).to(self.device),
            torch.from_numpy(lengths).to(self.device),
            prefix_len,
            len(shared) if prefix_len else None,
        )

    def _prompt_batch(
        self, common: CommonAttentionMetadata, spans: list[tuple[int, int]]
    ) -> PromptChunks:
        """The chunks (start, end rows) as (start, end, context length) rows with their
        block tables."""
        by_start = {common.query_start_loc[i]: i for i in range(common.num_reqs)}
        reqs = [by_start[start] for start, _ in spans]
        block_size = common.block_size
        lengths = [common.seq_lens[i] for i in reqs]
        tables = np.zeros((len(reqs), max(-(-n // block_size) for n in lengths)), dtype=np.int64)
        for row, i in enumerate(reqs):
            used = -(-lengths[row] // block_size)
            tables[row, :used] = common.block_tables[i][:used]
        rows = [[start, end, n] for (start, end), n in zip(spans, lengths)]
        return PromptChunks(torch.tensor(rows, dtype=torch.int64, device=self.device),
                            torch.from_numpy(tables).to(self.device))

    def _prompt_kernel(self, query: torch.Tensor, key_cache: torch.Tensor) -> bool:
        """Whether the prompt-attention kernel takes this step's chunks (`prompt_kernel_takes`);
        SDPA otherwise."""
        return query.dtype == torch.float32 and self.prompt_kernel_takes(query.shape[1],
                                                                         key_cache)

    def prompt_kernel_takes(self, num_heads: int, key_cache: torch.Tensor) -> bool:
        """Whether the prompt-attention kernel takes the chunks of float32 queries of
        num_heads heads over key_cache ([blocks, kv_heads, block_size, head_dim]): where the
        kernel's path is one of `prompt_paths` (prompt_kernel_paths()) and, on its bf16
        paths, the chunks attend in bf16."""
        if self.prompt_ops is None:
            return False
        path = self.prompt_ops.path(key_cache.dtype, num_heads, key_cache.shape[1],
                                    key_cache.shape[3])
        if path not in self.prompt_paths:
            return False
        return path == "float32" or (
            self.prompt_dtype(torch.float32, key_cache.dtype) == torch.bfloat16)

    def _padded_decode(
        self, common: CommonAttentionMetadata, decode_reqs: list[int], seq_lens: list[int]
    ) -> PaddedDecode:
        max_len = max(seq_lens)
        # Every context padded to max_len with block 0's first slot; the mask hides the padding.
        blocks = np.zeros((len(decode_reqs), max_len), dtype=np.int64)
        offsets = np.zeros((len(decode_reqs), max_len), dtype=np.int64)
        for row, i in enumerate(decode_reqs):
            blocks[row, : seq_lens[row]], offsets[row, : seq_lens[row]] = context_index(
                common.block_tables[i], seq_lens[row], common.block_size
            )
        lengths = torch.tensor(seq_lens, device=self.device)
        return PaddedDecode(
            torch.from_numpy(blocks).to(self.device),
            torch.from_numpy(offsets).to(self.device),
            (torch.arange(max_len, device=self.device)[None, :] < lengths[:, None])[:, None, None, :],
        )

    def _attend_cascade(
        self,
        output: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        cascade: Cascade,
        scale: float,
    ) -> None:
        attend_cascade(output, query, key_cache, value_cache, cascade, scale,
                       self.prompt_dtype(query.dtype, key_cache.dtype))

    def prompt_dtype(self, query_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
        """What prompt chunks attend in: bf16 for a bf16 or 8-bit float cache on a CPU with
        native bf16 (see the module docstring), else the queries' dtype."""
        narrow = cache_dtype == torch.bfloat16 or cache_dtype.itemsize == 1
        if narrow and self.native_bf16 and self.device.type == "cpu":
            return torch.bfloat16
        return query_dtype

    def bf16_decode(self, query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
        """Whether the C kernel's decode rows read the cache with the bf16 numerics of the
        prompt chunks (queries and probabilities rounded to bf16): where those attend in
        bf16, so that a position computed in a decode row and in a prompt chunk round alike."""
        return self.prompt_dtype(query_dtype, cache_dtype) == torch.bfloat16

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        assert isinstance(metadata, TorchSDPAMetadata)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if self.ops is not None:
            self.ops.write_kv(key_cache, value_cache, key, value, metadata.slot_mapping)
        else:
            assert metadata.write_index is not None
            blocks, offsets = metadata.write_index
            key_cache[blocks, :, offsets] = round_to_cache(key, key_cache.dtype)
            value_cache[blocks, :, offsets] = round_to_cache(value, value_cache.dtype)

        # o_proj reads it; a bf16 product pads its rows in place (kernels/row_buckets.py).
        output = empty_rows(tuple(query.shape), query.dtype, query.device)
        dtype = self.prompt_dtype(query.dtype, key_cache.dtype)
        chunks, cascades = metadata.prompt_chunks, metadata.cascades
        if metadata.prompt_batch is not None and self._prompt_kernel(query, key_cache):
            assert self.prompt_ops is not None
            self.prompt_ops.attend(output, query, key_cache, value_cache,
                                   metadata.prompt_batch, scale)
            chunks, cascades = [], []
        for chunk in chunks:
            start, end = chunk.start, chunk.end
            if chunk.context is None:
                k, v = key[start:end], value[start:end]
                if key_cache.itemsize == 1:  # as an 8-bit float cache holds them
                    k, v = round_to_cache(k, key_cache.dtype), round_to_cache(v, key_cache.dtype)
                k, v = k.transpose(0, 1).to(dtype), v.transpose(0, 1).to(dtype)
            else:
                k = gather_context(key_cache, *chunk.context).to(dtype)
                v = gather_context(value_cache, *chunk.context).to(dtype)
            # [1, heads, tokens, head_dim]: the 4-D form is what PyTorch's CPU flash kernel takes.
            out = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1).unsqueeze(0).to(dtype),
                k.unsqueeze(0),
                v.unsqueeze(0),
                attn_mask=chunk.causal_mask(self.device),
                is_causal=chunk.context is None,
                scale=scale,
                enable_gqa=True,
            )
            output[start:end] = out[0].transpose(0, 1)
        for cascade in cascades:
            self._attend_cascade(output, query, key_cache, value_cache, cascade, scale)

        if metadata.decode_batch is not None:
            assert self.ops is not None
            bf16 = self.bf16_decode(query.dtype, key_cache.dtype)
            if metadata.decode_batch.prefix_len and self.prompt_ops is not None:
                self.prompt_ops.decode_shared_prefix(
                    output, query, key_cache, value_cache, metadata.decode_batch, scale, bf16,
                    split=self.split_decode)
            else:
                self.ops.decode_prepared(
                    output, query, key_cache, value_cache, metadata.decode_batch, scale, bf16,
                    split=self.split_decode)
        elif metadata.padded_decode is not None:
            rows, padded = metadata.decode_rows, metadata.padded_decode
            # In the prompt chunks' dtype, as the C kernel's decode rows (bf16_decode).
            dtype = self.prompt_dtype(query.dtype, key_cache.dtype)
            q = query[rows].unsqueeze(2).to(dtype)  # [batch, heads, 1, head_dim]
            # [batch, kv_heads, max_len, head_dim]
            k = key_cache[padded.blocks, :, padded.offsets].transpose(1, 2).to(dtype)
            v = value_cache[padded.blocks, :, padded.offsets].transpose(1, 2).to(dtype)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=padded.mask, scale=scale, enable_gqa=True
            )
            output[rows] = out.squeeze(2).to(output.dtype)
        return output
