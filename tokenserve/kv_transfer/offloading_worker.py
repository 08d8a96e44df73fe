"""`OffloadingConnector`, worker side: the host pool itself (`num_slots` blocks of every
layer's keys and values) and the copies offloading.py asks for, loads before the step's
forward and saves after it."""

from __future__ import annotations

import time

import torch

from tokenserve.config import KVTransferConfig
from tokenserve.kv_transfer.offloading import OffloadingMetadata
from tokenserve.kv_transfer.worker_base import KVConnectorWorker


class OffloadingConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig) -> None:
        super().__init__(config)
        self.num_slots = int(config.kv_connector_extra_config["num_slots"])
        self.pool: torch.Tensor | None = None

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        block = self.block(0, 0)
        self.pool = torch.zeros(
            (self.num_slots, len(kv_caches), *block.shape), dtype=block.dtype, device="cpu"
        )

    def start_load_kv(self, metadata: object) -> None:
        if not isinstance(metadata, OffloadingMetadata) or not metadata.loads:
            return
        assert self.pool is not None
        started = time.perf_counter()
        for slot, block_id in metadata.loads:
            for layer_index in range(len(self.kv_caches)):
                self.block(layer_index, block_id).copy_(self.pool[slot, layer_index])
        self._output.bytes_loaded += len(metadata.loads) * self._slot_bytes
        self._output.seconds_loaded += time.perf_counter() - started

    def save_kv(self, metadata: object) -> None:
        if not isinstance(metadata, OffloadingMetadata) or not metadata.saves:
            return
        assert self.pool is not None
        started = time.perf_counter()
        for block_id, slot in metadata.saves:
            for layer_index in range(len(self.kv_caches)):
                self.pool[slot, layer_index].copy_(self.block(layer_index, block_id))
        self._output.bytes_saved += len(metadata.saves) * self._slot_bytes
        self._output.seconds_saved += time.perf_counter() - started

    @property
    def _slot_bytes(self) -> int:
        assert self.pool is not None
        return self.pool[0].numel() * self.pool.element_size()
