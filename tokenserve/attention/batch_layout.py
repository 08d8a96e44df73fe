"""A step's flat batch as attention sees it: each request's positions and KV-cache slots,
and its attention rows (tokens that attend together, how far they see, through which
blocks). The model runner and the draft model build their batches with it."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from tokenserve.attention.backend import CommonAttentionMetadata


class BatchLayout:
    """Filled request by request, in batch order; `query_start_loc[-1]` is the flat index at
    which the next request's tokens start."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.positions: list[np.ndarray] = []
        self.slots: list[np.ndarray] = []
        self.query_start_loc = [0]
        self.seq_lens: list[int] = []
        self.block_tables: list[list[int]] = []

    def add(
        self, start: int, end: int, block_ids: list[int], rows: Iterable[tuple[int, int]]
    ) -> None:
        """A request's positions start..end, written to its blocks' slots, attending as
        `rows` of (query length, sequence length)."""
        positions = np.arange(start, end, dtype=np.int64)
        block_table = np.asarray(block_ids, dtype=np.int64)
        self.positions.append(positions)
        self.slots.append(
            block_table[positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        for query_len, seq_len in rows:
            self.query_start_loc.append(self.query_start_loc[-1] + query_len)
            self.seq_lens.append(seq_len)
            self.block_tables.append(block_ids)

    def positions_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(self.positions)).to(device)

    def common_metadata(self, device: torch.device) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(self.slots)).to(device),
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            block_size=self.block_size,
        )
