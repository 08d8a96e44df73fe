"""Paged attention on CPU: PyTorch's scaled_dot_product_attention for prefill, a C kernel
for decode.

Each prefill chunk gets its own SDPA call (4-D, so PyTorch takes its flash kernel, GQA
included). A chunk with nothing cached before it attends over its own new keys and values
directly; a chunk that continues a context gathers that context once per layer and uses a
causal mask offset by the tokens already cached.

Cascade attention: chunks of a step that continue contexts sharing their first blocks
(a common system prompt, a prefix-cache hit) attend to that shared prefix in one call for
all of them: the prefix is gathered once and lies before every query, so no mask is
needed and the query heads of each kv head can all be rows of one call (no GQA copy).
Each chunk then attends to the rest of its context (the suffix) as above, and the two
parts merge by their log-sum-exps. It applies where at least two chunks share at least
CASCADE_MIN_PREFIX_TOKENS tokens (benchmarks/cascade_attention.py, docs/BENCHMARKS.md:
from 1,024 tokens on it was faster at every chunk count measured, at 768 only from ~8
chunks); `--disable-cascade-attn` turns it off.

Decode rows (one query token) of all requests go to the paged-decode C kernel
(kernels.paged_attention), which reads each query in place from the fused QKV tensor and
each context in place from its blocks, and writes its rows of the output; a second
kernel writes the step's new keys and values into their slots. Where the kernels cannot
be built, decode rows are attended in one padded SDPA call over gathered contexts
instead (the same results, more memory traffic). Index tensors are built once per step,
in `prepare`.

Each layer's cache is K and V apart, [num_blocks, num_kv_heads, block_size, head_dim]: a
kv head's keys within a block are contiguous, which is what the decode kernel streams. A
token's slot is block * block_size + offset; a gather indexes [blocks, :, offsets]. The
cache may hold a narrower dtype than the model (--kv-cache-dtype bfloat16): keys and values
are rounded as they are written and widened as they are read. A first chunk attends to its
keys and values as computed; a chunk that continues a context reads all of it from the
cache, its own new tokens included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tokenserve import kernels
from tokenserve.attention.backend import AttentionBackend, AttentionMetadata

# The shortest shared prefix that cascade attention takes (see the module docstring).
CASCADE_MIN_PREFIX_TOKENS = 1024


def _context_index(
    block_table: list[int], seq_len: int, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Where a context's tokens lie in the cache: block ids and offsets in them."""
    positions = np.arange(seq_len)
    return np.asarray(block_table, dtype=np.int64)[positions // block_size], positions % block_size


def _gather_context(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A context's first seq_len tokens as [kv_heads, seq_len, head_dim]: whole blocks
    copied (twice as fast as gathering token by token), their heads then put first."""
    _, num_kv_heads, _, head_dim = cache.shape
    gathered = cache.index_select(0, blocks).transpose(0, 1)
    return gathered.reshape(num_kv_heads, -1, head_dim)[:, :seq_len]


@dataclass
class _SuffixGroup:
    """Cascade chunks of one shape: query_len queries over suffix_len suffix keys each."""

    rows: torch.Tensor  # [chunks * query_len]: the chunks' rows among the cascade's rows
    blocks: list[torch.Tensor]  # per chunk, the blocks holding its suffix
    query_len: int
    suffix_len: int
    mask: torch.Tensor  # [query_len, suffix_len] bool: query j sees suffix key i


@dataclass
class _Cascade:
    """Prefill chunks whose contexts share their first `prefix_len` tokens."""

    prefix_blocks: torch.Tensor
    prefix_len: int
    rows: torch.Tensor  # the chunks' rows of the step, chunk by chunk
    groups: list[_SuffixGroup]
    # Float masks with each query row repeated for the query heads of a kv head, by
    # (group index, heads per kv head); built by the first layer, reused by the rest.
    masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)


def _flash_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU flash kernel on [batch, heads, len, dim] (the same number of query and
    kv heads): the output and each query's log-sum-exp of its scaled scores."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, attn_mask=mask, scale=scale
    )
    return out, lse


def _offset_causal_mask(context_len: int, query_len: int, device: torch.device) -> torch.Tensor:
    """[query_len, context_len] bool: the queries are the context's last query_len
    positions, and query j (at context_len - query_len + j) sees the keys up to it."""
    query_pos = torch.arange(context_len - query_len, context_len, device=device)
    return torch.arange(context_len, device=device)[None, :] <= query_pos[:, None]


def _shared_blocks(tables: list[list[int]], limit: int) -> int:
    """How many leading blocks all the tables share, at most limit."""
    leading = np.array([table[:limit] for table in tables], dtype=np.int64)
    same = (leading == leading[0]).all(axis=0)
    return int(limit if same.all() else same.argmin())


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def __init__(self, use_kernels: bool = True, cascade: bool = True) -> None:
        self.ops = kernels.paged_attention() if use_kernels else None
        self.cascade = cascade and hasattr(
            torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"
        )

    def prepare(self, metadata: AttentionMetadata, device: torch.device) -> None:
        decode_rows: list[int] = []
        decode_reqs: list[int] = []
        # (first row, end row, the context's (blocks, length) if it continues one, mask)
        prefills: list[tuple[int, int, tuple[torch.Tensor, int] | None, torch.Tensor | None]] = []
        continuing: list[int] = []  # requests whose chunk continues a cached context
        for i in range(metadata.num_reqs):
            start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
            if end - start == 1:
                decode_rows.append(start)
                decode_reqs.append(i)
            elif metadata.seq_lens[i] == end - start:
                # Nothing cached before this chunk: its own keys are the whole context.
                prefills.append((start, end, None, None))
            else:
                continuing.append(i)
        cascades, alone = (
            self._plan_cascades(metadata, continuing, device) if self.cascade else ([], continuing)
        )
        for i in alone:
            start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
            seq_len = metadata.seq_lens[i]
            num_blocks = -(-seq_len // metadata.block_size)
            blocks = torch.tensor(metadata.block_tables[i][:num_blocks], device=device)
            mask = _offset_causal_mask(seq_len, end - start, device)
            prefills.append((start, end, (blocks, seq_len), mask))

        data: dict = {"prefills": prefills, "cascades": cascades, "decode_rows": None}
        if self.ops is None:
            slots = metadata.slot_mapping
            data["write_index"] = (slots // metadata.block_size, slots % metadata.block_size)
        if decode_rows:
            seq_lens = [metadata.seq_lens[i] for i in decode_reqs]
            data["decode_rows"] = torch.tensor(decode_rows, device=device)
            if self.ops is not None:
                num_blocks = max(-(-n // metadata.block_size) for n in seq_lens)
                tables = np.zeros((len(decode_reqs), num_blocks), dtype=np.int64)
                for row, i in enumerate(decode_reqs):
                    used = -(-seq_lens[row] // metadata.block_size)
                    tables[row, :used] = metadata.block_tables[i][:used]
                data["decode_batch"] = kernels.DecodeRows(
                    data["decode_rows"],
                    torch.from_numpy(tables).to(device),
                    torch.tensor(seq_lens, dtype=torch.int64, device=device),
                )
            else:
                max_len = max(seq_lens)
                # Pad every context to max_len with block 0's first slot; the mask hides the
                # padding.
                blocks = np.zeros((len(decode_reqs), max_len), dtype=np.int64)
                offsets = np.zeros((len(decode_reqs), max_len), dtype=np.int64)
                for row, i in enumerate(decode_reqs):
                    blocks[row, : seq_lens[row]], offsets[row, : seq_lens[row]] = _context_index(
                        metadata.block_tables[i], seq_lens[row], metadata.block_size
                    )
                lengths = torch.tensor(seq_lens, device=device)
                data["decode_context"] = (
                    torch.from_numpy(blocks).to(device),
                    torch.from_numpy(offsets).to(device),
                )
                data["decode_mask"] = (
                    torch.arange(max_len, device=device)[None, :] < lengths[:, None]
                )[:, None, None, :]
        metadata.backend_data = data

    def _plan_cascades(
        self, metadata: AttentionMetadata, continuing: list[int], device: torch.device
    ) -> tuple[list[_Cascade], list[int]]:
        """Cascades for the requests whose chunks continue a context, and the requests left
        to attend alone. Chunks are grouped by their context's first block; a group is a
        cascade if at least two share CASCADE_MIN_PREFIX_TOKENS tokens or more, all cached
        before any of its queries."""
        block_size = metadata.block_size
        by_first_block: dict[int, list[int]] = {}
        for request in continuing:
            by_first_block.setdefault(metadata.block_tables[request][0], []).append(request)
        cascades, taken = [], set()
        for requests in by_first_block.values():
            if len(requests) < 2:
                continue
            # Only blocks wholly before a chunk's first query can be shared: its queries
            # see all of them, so the shared part needs no mask.
            cached = min(metadata.seq_lens[r] - metadata.query_len(r) for r in requests)
            tables = [metadata.block_tables[r] for r in requests]
            num_shared = _shared_blocks(tables, cached // block_size)
            prefix_len = num_shared * block_size
            if prefix_len < CASCADE_MIN_PREFIX_TOKENS:
                continue
            rows, offset = [], 0
            shapes: dict[tuple[int, int], list[tuple[int, int, torch.Tensor]]] = {}
            for request in requests:
                start, end = metadata.query_start_loc[request : request + 2]
                seq_len = metadata.seq_lens[request]
                used = -(-seq_len // block_size)
                suffix_blocks = metadata.block_tables[request][num_shared:used]
                rows.append(torch.arange(start, end))
                shapes.setdefault((end - start, seq_len - prefix_len), []).append(
                    (offset, end - start, torch.tensor(suffix_blocks, device=device))
                )
                offset += end - start
            groups = [
                _SuffixGroup(
                    rows=torch.cat([torch.arange(o, o + n) for o, n, _ in chunks]).to(device),
                    blocks=[blocks for _, _, blocks in chunks],
                    query_len=query_len,
                    suffix_len=suffix_len,
                    mask=_offset_causal_mask(suffix_len, query_len, device),
                )
                for (query_len, suffix_len), chunks in shapes.items()
            ]
            cascades.append(
                _Cascade(
                    prefix_blocks=torch.tensor(tables[0][:num_shared], device=device),
                    prefix_len=prefix_len,
                    rows=torch.cat(rows).to(device),
                    groups=groups,
                )
            )
            taken.update(requests)
        return cascades, [request for request in continuing if request not in taken]

    def _attend_cascade(
        self,
        output: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        cascade: _Cascade,
        scale: float,
    ) -> None:
        """Writes the cascade's rows of output: the shared prefix in one call for all its
        queries, each chunk's suffix by shape group, merged by log-sum-exp."""
        num_rows = len(cascade.rows)
        _, num_heads, head_dim = query.shape
        num_kv_heads = key_cache.shape[1]
        group = num_heads // num_kv_heads
        # [rows, kv_heads, group, dim]: the query heads of kv head h are h*group...
        q = query.index_select(0, cascade.rows).view(num_rows, num_kv_heads, group, head_dim)
        k = _gather_context(key_cache, cascade.prefix_blocks, cascade.prefix_len)
        v = _gather_context(value_cache, cascade.prefix_blocks, cascade.prefix_len)
        # Every query sees the whole prefix: per kv head, its queries are rows of one call.
        prefix_out, prefix_lse = _flash_with_lse(
            q.permute(1, 0, 2, 3).reshape(1, num_kv_heads, num_rows * group, head_dim),
            k.to(query.dtype).unsqueeze(0),
            v.to(query.dtype).unsqueeze(0),
            scale,
        )
        prefix_out = prefix_out.reshape(num_kv_heads, num_rows, group, head_dim).transpose(0, 1)
        prefix_lse = prefix_lse.reshape(num_kv_heads, num_rows, group).transpose(0, 1)
        suffix_out = torch.empty_like(prefix_out)
        suffix_lse = torch.empty_like(prefix_lse)
        for index, suffix in enumerate(cascade.groups):
            num_chunks, query_len = len(suffix.blocks), suffix.query_len
            mask = cascade.masks.get((index, group))
            if mask is None:
                # Rows query_j * group + g, as the queries are laid out below.
                mask = torch.zeros(suffix.mask.shape, dtype=query.dtype)
                mask.masked_fill_(~suffix.mask, float("-inf"))
                mask = cascade.masks[index, group] = mask.repeat_interleave(group, 0)
            k, v = (
                torch.stack([_gather_context(cache, b, suffix.suffix_len) for b in suffix.blocks])
                for cache in (key_cache, value_cache)
            )
            q_chunks = q.index_select(0, suffix.rows).view(
                num_chunks, query_len, num_kv_heads, group, head_dim
            )
            out, lse = _flash_with_lse(
                q_chunks.permute(0, 2, 1, 3, 4).reshape(
                    num_chunks, num_kv_heads, query_len * group, head_dim
                ),
                k.to(query.dtype),
                v.to(query.dtype),
                scale,
                mask,
            )
            out = out.reshape(num_chunks, num_kv_heads, query_len, group, head_dim)
            lse = lse.reshape(num_chunks, num_kv_heads, query_len, group)
            # Back to [rows, kv_heads, group, ...], the chunks' rows in order.
            suffix_out[suffix.rows] = out.permute(0, 2, 1, 3, 4).flatten(0, 1)
            suffix_lse[suffix.rows] = lse.permute(0, 2, 1, 3).flatten(0, 1)
        # softmax over both parts = each part's softmax weighted by its share of the sum.
        top = torch.maximum(prefix_lse, suffix_lse)
        prefix_weight = (prefix_lse - top).exp_()
        suffix_weight = (suffix_lse - top).exp_()
        total = prefix_weight + suffix_weight
        merged = prefix_out * (prefix_weight / total).unsqueeze(-1)
        merged.add_(suffix_out * (suffix_weight / total).unsqueeze(-1))
        output.index_copy_(0, cascade.rows, merged.reshape(num_rows, num_heads, head_dim))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        data = metadata.backend_data
        if self.ops is not None:
            self.ops.write_kv(key_cache, value_cache, key, value, metadata.slot_mapping)
        else:
            blocks, offsets = data["write_index"]
            key_cache[blocks, :, offsets] = key.to(key_cache.dtype)
            value_cache[blocks, :, offsets] = value.to(value_cache.dtype)

        output = torch.empty_like(query)
        for start, end, context, mask in data["prefills"]:
            if context is None:
                k, v = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)
            else:
                k = _gather_context(key_cache, *context).to(query.dtype)
                v = _gather_context(value_cache, *context).to(query.dtype)
            # [1, heads, tokens, head_dim]: the 4-D form is what PyTorch's CPU flash kernel takes.
            out = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1).unsqueeze(0),
                k.unsqueeze(0),
                v.unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )
            output[start:end] = out[0].transpose(0, 1)
        for cascade in data["cascades"]:
            self._attend_cascade(output, query, key_cache, value_cache, cascade, scale)

        rows = data["decode_rows"]
        if rows is None:
            return output
        if self.ops is not None:
            self.ops.decode_prepared(
                output, query, key_cache, value_cache, data["decode_batch"], scale
            )
            return output
        blocks, offsets = data["decode_context"]
        q = query[rows].unsqueeze(2)  # [batch, heads, 1, head_dim]
        # [batch, kv_heads, max_len, head_dim]
        k = key_cache[blocks, :, offsets].transpose(1, 2).to(query.dtype)
        v = value_cache[blocks, :, offsets].transpose(1, 2).to(query.dtype)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=data["decode_mask"], scale=scale, enable_gqa=True
        )
        output[rows] = out.squeeze(2)
        return output
