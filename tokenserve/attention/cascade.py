"""Cascade attention on CPU: prefill chunks of a step that continue contexts sharing their
first blocks (a common system prompt, a prefix-cache hit) attend to that shared prefix in
one call for all of them. The prefix is gathered once and lies before every query, so no
mask is needed and the query heads of each kv head can all be rows of one call (no GQA
copy). Each chunk then attends to the rest of its context (the suffix), and the two parts
merge by their log-sum-exps. `plan_cascades` finds them once per step (in the backend's
metadata); `attend_cascade` runs one per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenserve.attention.backend import CommonAttentionMetadata
from tokenserve.attention.paged_context import gather_context, offset_causal_mask


@dataclass
class SuffixGroup:
    """Cascade chunks of one shape: query_len queries over suffix_len suffix keys each."""

    rows: torch.Tensor  # [chunks * query_len]: the chunks' rows among the cascade's rows
    blocks: list[torch.Tensor]  # per chunk, the blocks holding its suffix
    query_len: int
    suffix_len: int
    mask: torch.Tensor  # [query_len, suffix_len] bool: query j sees suffix key i


@dataclass
class Cascade:
    """Prefill chunks whose contexts share their first `prefix_len` tokens."""

    prefix_blocks: torch.Tensor
    prefix_len: int
    rows: torch.Tensor  # the chunks' rows of the step, chunk by chunk
    groups: list[SuffixGroup]
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


def _shared_blocks(tables: list[list[int]], limit: int) -> int:
    """How many leading blocks all the tables share, at most limit."""
    leading = np.array([table[:limit] for table in tables], dtype=np.int64)
    same = (leading == leading[0]).all(axis=0)
    return int(limit if same.all() else same.argmin())


def plan_cascades(
    common: CommonAttentionMetadata,
    continuing: list[int],
    min_prefix_tokens: int,
    device: torch.device,
) -> tuple[list[Cascade], list[int]]:
    """Cascades for the requests whose chunks continue a context, and the requests left
    to attend alone. Chunks are grouped by their context's first block; a group is a
    cascade if at least two share min_prefix_tokens tokens or more, all cached
    before any of its queries."""
    block_size = common.block_size
    by_first_block: dict[int, list[int]] = {}
    for request in continuing:
        by_first_block.setdefault(common.block_tables[request][0], []).append(request)
    cascades, taken = [], set()
    for requests in by_first_block.values():
        if len(requests) < 2:
            continue
        # Only blocks wholly before a chunk's first query can be shared: its queries
        # see all of them, so the shared part needs no mask.
        cached = min(common.seq_lens[r] - common.query_len(r) for r in requests)
        tables = [common.block_tables[r] for r in requests]
        num_shared = _shared_blocks(tables, cached // block_size)
        prefix_len = num_shared * block_size
        if prefix_len < min_prefix_tokens:
            continue
        rows, offset = [], 0
        shapes: dict[tuple[int, int], list[tuple[int, int, torch.Tensor]]] = {}
        for request in requests:
            start, end = common.query_start_loc[request : request + 2]
            seq_len = common.seq_lens[request]
            used = -(-seq_len // block_size)
            suffix_blocks = common.block_tables[request][num_shared:used]
            rows.append(torch.arange(start, end))
            shapes.setdefault((end - start, seq_len - prefix_len), []).append(
                (offset, end - start, torch.tensor(suffix_blocks, device=device))
            )
            offset += end - start
        groups = [
            SuffixGroup(
                rows=torch.cat([torch.arange(o, o + n) for o, n, _ in chunks]).to(device),
                blocks=[blocks for _, _, blocks in chunks],
                query_len=query_len,
                suffix_len=suffix_len,
                mask=offset_causal_mask(suffix_len, query_len, device),
            )
            for (query_len, suffix_len), chunks in shapes.items()
        ]
        cascades.append(
            Cascade(
                prefix_blocks=torch.tensor(tables[0][:num_shared], device=device),
                prefix_len=prefix_len,
                rows=torch.cat(rows).to(device),
                groups=groups,
            )
        )
        taken.update(requests)
    return cascades, [request for request in continuing if request not in taken]


def attend_cascade(
    output: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cascade: Cascade,
    scale: float,
    dtype: torch.dtype | None = None,
) -> None:
    """Writes the cascade's rows of output: the shared prefix in one call for all its
    queries, each chunk's suffix by shape group, merged by log-sum-exp (in output's dtype).
    The calls compute in `dtype` (default: the queries')."""
    dtype = query.dtype if dtype is None else dtype
    num_rows = len(cascade.rows)
    _, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    # [rows, kv_heads, group, dim]: the query heads of kv head h are h*group...
    q = query.index_select(0, cascade.rows).to(dtype)
    q = q.view(num_rows, num_kv_heads, group, head_dim)
    k = gather_context(key_cache, cascade.prefix_blocks, cascade.prefix_len)
    v = gather_context(value_cache, cascade.prefix_blocks, cascade.prefix_len)
    # Every query sees the whole prefix: per kv head, its queries are rows of one call.
    prefix_out, prefix_lse = _flash_with_lse(
        q.permute(1, 0, 2, 3).reshape(1, num_kv_heads, num_rows * group, head_dim),
        k.to(dtype).unsqueeze(0),
        v.to(dtype).unsqueeze(0),
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
            mask = torch.zeros(suffix.mask.shape, dtype=dtype)
            mask.masked_fill_(~suffix.mask, float("-inf"))
            mask = cascade.masks[index, group] = mask.repeat_interleave(group, 0)
        k, v = (
            torch.stack([gather_context(cache, b, suffix.suffix_len) for b in suffix.blocks])
            for cache in (key_cache, value_cache)
        )
        q_chunks = q.index_select(0, suffix.rows).view(
            num_chunks, query_len, num_kv_heads, group, head_dim
        )
        out, lse = _flash_with_lse(
            q_chunks.permute(0, 2, 1, 3, 4).reshape(
                num_chunks, num_kv_heads, query_len * group, head_dim
            ),
            k.to(dtype),
            v.to(dtype),
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
    merged = prefix_out.to(output.dtype) * (prefix_weight / total).unsqueeze(-1)
    merged.add_(suffix_out.to(output.dtype) * (suffix_weight / total).unsqueeze(-1))
    output.index_copy_(0, cascade.rows, merged.reshape(num_rows, num_heads, head_dim))
