"""Reading a request's context out of the paged cache, and the masks of queries that sit at
the end of a context: what the CPU backend's prefill, cascade and padded-decode paths share.

A layer's K (or V) cache is [num_blocks, num_kv_heads, block_size, head_dim]; a token's slot
is block * block_size + offset.
"""

from __future__ import annotations

import numpy as np
import torch


def context_index(
    block_table: list[int], seq_len: int, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Where a context's tokens lie in the cache: block ids and offsets in them."""
    positions = np.arange(seq_len)
    return np.asarray(block_table, dtype=np.int64)[positions // block_size], positions % block_size


def gather_context(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A context's first seq_len tokens as [kv_heads, seq_len, head_dim]: whole blocks
    copied (faster than gathering token by token), their heads then put first."""
    _, num_kv_heads, _, head_dim = cache.shape
    gathered = cache.index_select(0, blocks).transpose(0, 1)
    return gathered.reshape(num_kv_heads, -1, head_dim)[:, :seq_len]


def offset_causal_mask(context_len: int, query_len: int, device: torch.device) -> torch.Tensor:
    """[query_len, context_len] bool: the queries are the context's last query_len
    positions, and query j (at context_len - query_len + j) sees the keys up to it."""
    query_pos = torch.arange(context_len - query_len, context_len, device=device)
    return torch.arange(context_len, device=device)[None, :] <= query_pos[:, None]
