"""The worker side of a KV connector (vLLM V1's `KVConnectorBase_V1`, worker half).

The model runner registers its KV caches once, then each step calls `start_load_kv`
before the forward and `save_kv` + `wait_for_save` after it (per step, not per layer: the
CPU forward is one call), and returns `get_output` in its ModelRunnerOutput.
`wait_for_layer_load` / `save_kv_layer` are the per-layer form for a backend that
interleaves copies with layers; the per-step runner does not call them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tokenserve.config import KVTransferConfig
from tokenserve.messages.model_runner_output import KVConnectorOutput


class KVConnectorWorker(ABC):
    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        self.kv_caches: list[torch.Tensor] = []
        self._output = KVConnectorOutput()

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """One cache per layer, `[2, num_blocks, ...]` (keys, values; a block along dim 1)."""
        self.kv_caches = kv_caches

    @abstractmethod
    def start_load_kv(self, metadata: object) -> None:
        """Begin (or, synchronously, do) the step's loads, before the forward."""

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Block until layer `layer_index`'s loads are in place (per-layer runners)."""

    def save_kv_layer(self, layer_index: int, metadata: object) -> None:
        """Start saving one layer's blocks of the step (per-layer runners)."""

    @abstractmethod
    def save_kv(self, metadata: object) -> None:
        """Save the step's completed blocks, after the forward."""

    def wait_for_save(self) -> None:
        """Block until the step's saves are done (the blocks may then be reused)."""

    def get_output(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """What finished since the last step (`finished_req_ids`: requests the scheduler
        ended), with this step's counters; the counters start again."""
        output, self._output = self._output, KVConnectorOutput()
        return output

    def shutdown(self) -> None:
        """Close connections and files."""

    def block(self, layer_index: int, block_id: int) -> torch.Tensor:
        """One layer's keys and values of a block: a view `[2, ...]`."""
        return self.kv_caches[layer_index][:, block_id]

    def block_bytes(self, block_id: int) -> bytes:
        """Every layer's keys and values of a block, as raw bytes."""
        stacked = torch.stack([self.block(i, block_id) for i in range(len(self.kv_caches))])
        return stacked.contiguous().view(torch.uint8).numpy().tobytes()

    def write_block(self, block_id: int, payload: bytes) -> bool:
        """Copy a payload made by `block_bytes` into a block; False if its size is wrong."""
        first = self.block(0, block_id)
        expected = len(self.kv_caches) * first.numel() * first.element_size()
        if len(payload) != expected:
            return False
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(first.dtype)
        data = data.view(len(self.kv_caches), *first.shape)
        for layer_index in range(len(self.kv_caches)):
            self.block(layer_index, block_id).copy_(data[layer_index])
        return True
