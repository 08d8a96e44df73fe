"""`SharedStorageConnector`, worker side: before the forward, the step's pinned block files
are read, checked again and copied into their blocks; after it, the blocks the step
completed are written to the store (shared_storage.py decides which)."""

from __future__ import annotations

import time
from pathlib import Path

from tokenserve.config import KVTransferConfig
from tokenserve.kv_transfer.shared_storage import SharedStorageMetadata, open_store
from tokenserve.kv_transfer.worker_base import KVConnectorWorker


class SharedStorageConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig) -> None:
        super().__init__(config)
        self.store = open_store(config)

    def start_load_kv(self, metadata: object) -> None:
        if not isinstance(metadata, SharedStorageMetadata) or not metadata.loads:
            return
        started = time.perf_counter()
        corrupt_before = self.store.num_corrupt
        for request_id, blocks in metadata.loads.items():
            for index, (block_id, pinned) in enumerate(blocks):
                payload = self.store.load(Path(pinned))
                if payload is None or not self.write_block(block_id, payload):
                    # Changed since its check: the request recomputes (scheduler side).
                    self._output.failed_recving.add(request_id)
                    for _, rest in blocks[index + 1 :]:
                        self.store.unpin(Path(rest))
                    break
                self._output.bytes_loaded += len(payload)
        self._output.corrupt_blocks += self.store.num_corrupt - corrupt_before
        self._output.seconds_loaded += time.perf_counter() - started

    def save_kv(self, metadata: object) -> None:
        if not isinstance(metadata, SharedStorageMetadata) or not metadata.saves:
            return
        started = time.perf_counter()
        for block_id, block_hash in metadata.saves:
            self._output.bytes_saved += self.store.save(block_hash, self.block_bytes(block_id))
        self._output.seconds_saved += time.perf_counter() - started

    def shutdown(self) -> None:
        self.store.shutdown()
