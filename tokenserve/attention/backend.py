"""The attention-backend interface: how a layer writes new K/V into the paged cache
and attends over each request's blocks.

The model runner builds one `AttentionMetadata` per step; every layer of the model
reuses it. A backend may precompute what it needs from it once per step
(`prepare`), so that per-layer work is only the attention itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """The flat batch of one step, as attention needs it.

    Requests are laid out one after another in the token dimension: request i owns
    rows query_start_loc[i]:query_start_loc[i+1]. `seq_lens[i]` is its context length
    once this step's tokens are written (cached + new), so its queries sit at the last
    query_len positions of that context.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs]
    block_tables: list[list[int]]  # per request, its block ids
    block_size: int
    # Filled by the backend's prepare(): whatever it derives once per step.
    backend_data: dict[str, Any] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, index: int) -> int:
        return self.query_start_loc[index + 1] - self.query_start_loc[index]


class AttentionBackend(ABC):
    """One implementation per device family (CPU, CUDA, ...); one instance per engine."""

    name: str

    @abstractmethod
    def prepare(self, metadata: AttentionMetadata, device: torch.device) -> None:
        """Derive per-step data (index tensors, masks) once, before the layers run."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write key/value into their slots, then attend causally over each request's context."""


def get_attention_backend(
    device: torch.device, dtype: torch.dtype, cascade: bool = True
) -> AttentionBackend:
    if device.type == "cpu":
        from tokenserve.attention.torch_sdpa import TorchSDPABackend

        # The C decode kernel is fp32; other dtypes take the pure-torch path.
        return TorchSDPABackend(use_kernels=dtype == torch.float32, cascade=cascade)
    raise ValueError(f"No attention backend for device type {device.type!r} yet (only 'cpu').")
