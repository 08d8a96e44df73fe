"""`SharedStorageConnector` (vLLM's name), scheduler side: full blocks kept as files by
block hash in `shared_storage_path` (block_files.py), found on a local prefix-cache miss.

Lookups check each file's checksum and pin it, so what the worker loads before the step's
forward is what was checked (loads are synchronous: within the step, per step). Blocks a
step completes are saved by the worker after its forward, unless already stored.
Extra config: `shared_storage_path` (required), `max_size_gb` (optional size limit, least
recently used blocks evicted past it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenserve.config import KVTransferConfig
from tokenserve.kv_transfer.base import (
    ConnectorRequest,
    KVConnectorMetadata,
    KVConnectorScheduler,
    ScheduledRequest,
)
from tokenserve.kv_transfer.block_files import BlockFileStore

GIB = 1 << 30


@dataclass
class SharedStorageMetadata(KVConnectorMetadata):
    # Request id → (block id, pinned file) per block to load before this step's forward.
    loads: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    # (block id, block hash) per block to save after this step's forward.
    saves: list[tuple[int, bytes]] = field(default_factory=list)


def open_store(config: KVTransferConfig) -> BlockFileStore:
    extra = config.kv_connector_extra_config
    max_size_gb = extra.get("max_size_gb")
    max_bytes = None if max_size_gb is None else int(float(max_size_gb) * GIB)
    return BlockFileStore(extra["shared_storage_path"], config.kv_layout_key, max_bytes)


class SharedStorageConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        super().__init__(config, block_size)
        self.store = open_store(config)
        # Pins of each request's latest lookup, until its blocks are allocated.
        self._matched: dict[str, list[Path]] = {}
        self._loads: dict[str, list[tuple[int, str]]] = {}

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        self._release(request.request_id)
        if not self.config.is_consumer or request.skip_prefix_cache:
            return 0, False
        first = num_computed_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size  # one token left to compute
        pins = []
        corrupt_before = self.store.num_corrupt
        for block_hash in request.block_hashes[first:last]:
            pinned = self.store.pin(block_hash)
            if pinned is None:
                break
            pins.append(pinned)
        self.stats.corrupt_blocks += self.store.num_corrupt - corrupt_before
        self._matched[request.request_id] = pins
        return len(pins) * self.block_size, False

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        pins = self._matched.pop(request.request_id, [])
        if block_ids:
            self._loads[request.request_id] = [
                (block_id, str(pinned)) for block_id, pinned in zip(block_ids, pins)
            ]
        for pinned in pins[len(block_ids) :]:
            self.store.unpin(pinned)

    def build_connector_meta(self, scheduled: list[ScheduledRequest]) -> SharedStorageMetadata:
        metadata = SharedStorageMetadata(loads=self._loads)
        self._loads = {}
        if not self.config.is_producer:
            return metadata
        chosen: set[bytes] = set()
        for item in scheduled:
            for block_id, block_hash in item.completed_blocks(self.block_size):
                if block_hash in chosen or self.store.contains(block_hash):
                    continue
                chosen.add(block_hash)
                metadata.saves.append((block_id, block_hash))
        return metadata

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, None]:
        self._release(request.request_id)
        return False, None

    def shutdown(self) -> None:
        self.store.shutdown()

    def _release(self, request_id: str) -> None:
        for pinned in self._matched.pop(request_id, []):
            self.store.unpin(pinned)
