"""The attention-backend interface: what the model runner hands a backend each step, what
the backend hands the model's layers, and how it lays out and allocates the KV cache.

Each step the runner builds one `CommonAttentionMetadata` (the flat batch as every backend
sees it) and asks the backend to turn it into its own typed `AttentionMetadata` once
(`build_metadata`), so that per-layer work is only the attention itself. The model passes
that object and each layer's cache through to `forward` without looking inside either.
"""

from __future__ import annotations

import math
import mmap
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class CommonAttentionMetadata:
    """The flat batch of one step, as the runner builds it for any backend.

    Requests are laid out one after another in the token dimension: request i owns rows
    query_start_loc[i]:query_start_loc[i+1] (any number of them: a prompt chunk, one decode
    token, or several tokens of a running request). `seq_lens[i]` is its context length once
    this step's tokens are written (cached + new), so its queries sit at the last query_len
    positions of that context.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs]
    block_tables: list[list[int]]  # per request, its block ids
    block_size: int

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def query_len(self, index: int) -> int:
        return self.query_start_loc[index + 1] - self.query_start_loc[index]


@dataclass
class AttentionMetadata:
    """A backend's per-step metadata; each backend subclasses it with typed fields."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_tokens: int


class AttentionBackend(ABC):
    """One implementation per device family (CPU, CUDA, ...); one instance per engine. It
    owns the KV cache's layout: the runner allocates through it and the model only passes
    each layer's cache back to `forward`."""

    name: str

    @abstractmethod
    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """The shape of one layer's cache (keys and values together)."""

    @abstractmethod
    def kv_cache_block_dim(self) -> int:
        """The dimension of `kv_cache_shape` that indexes the blocks."""

    def allocate_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[torch.Tensor]:
        """One cache per layer. Zeroed, not empty: padded gathers may read unused slots,
        which must hold finite values."""
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        return [zeros_on_first_touch(shape, dtype, device) for _ in range(num_layers)]

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """Derive the step's index tensors, masks and plans once, before the layers run."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # one layer's, as allocate_kv_cache made it
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write key/value into their slots, then attend causally over each request's context."""


def zeros_on_first_touch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor whose CPU memory the kernel zeroes page by page as it is first used
    (an anonymous mapping), instead of all of it at start: a 4 GiB cache costs no start time
    and only the blocks in use count in the resident memory."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, max(num_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor keeps the mapping alive (torch.frombuffer holds a reference to it).
    return torch.frombuffer(buffer, dtype=torch.uint8)[:num_bytes].view(dtype).view(shape)
