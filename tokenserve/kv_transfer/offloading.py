"""`OffloadingConnector` (vLLM's `--kv-offloading-size`), scheduler side: a second, larger
pool of blocks in host memory behind the main KV cache.

Every full block a step completes is copied into the pool (write-through, so a block the
main cache evicts later is already there), keyed by block hash; on a local prefix-cache
miss, the run of blocks the pool holds is copied back instead of recomputed. This side
owns the pool's index (block hash → slot, least recently used evicted first); the worker
side (offloading_worker.py) only copies between the slots and blocks it is told, loads
before the step's forward and saves after it. A slot being loaded in a step is never
given to a save of the same step. Extra config: `num_slots`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tokenserve.config import KVTransferConfig
from tokenserve.kv_transfer.base import (
    ConnectorRequest,
    KVConnectorMetadata,
    KVConnectorScheduler,
    ScheduledRequest,
)


@dataclass
class OffloadingMetadata(KVConnectorMetadata):
    # (slot, block id): copied from the pool into the block before the forward.
    loads: list[tuple[int, int]] = field(default_factory=list)
    # (block id, slot): copied from the block into the pool after the forward.
    saves: list[tuple[int, int]] = field(default_factory=list)


class OffloadingConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        super().__init__(config, block_size)
        self.num_slots = int(config.kv_connector_extra_config["num_slots"])
        self.index: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.slot_hashes: dict[int, bytes] = {}
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self._matched: dict[str, list[int]] = {}
        self._loads: list[tuple[int, int]] = []

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if request.skip_prefix_cache:
            return 0, False
        first = num_computed_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size  # one token left to compute
        slots = []
        for block_hash in request.block_hashes[first:last]:
            slot = self.index.get(block_hash)
            if slot is None:
                break
            slots.append(slot)
        self._matched[request.request_id] = slots
        return len(slots) * self.block_size, False

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        slots = self._matched.pop(request.request_id, [])
        for block_id, slot in zip(block_ids, slots):
            self._loads.append((slot, block_id))
            self.index.move_to_end(self.slot_hashes[slot])  # most recently used

    def build_connector_meta(self, scheduled: list[ScheduledRequest]) -> OffloadingMetadata:
        metadata = OffloadingMetadata(loads=self._loads)
        self._loads = []
        loading = {slot for slot, _ in metadata.loads}
        for item in scheduled:
            for block_id, block_hash in item.completed_blocks(self.block_size):
                if block_hash in self.index:
                    self.index.move_to_end(block_hash)
                    continue
                slot = self._take_slot(loading)
                if slot is None:
                    return metadata  # every slot is being loaded this step
                self.index[block_hash] = slot
                self.slot_hashes[slot] = block_hash
                metadata.saves.append((block_id, slot))
        return metadata

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, None]:
        self._matched.pop(request.request_id, None)
        return False, None

    def _take_slot(self, loading: set[int]) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for block_hash, slot in self.index.items():
            if slot not in loading:
                del self.index[block_hash]
                return slot
        return None
