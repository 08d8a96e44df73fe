"""The scheduler side of the connector `kv_connector` names (the engine core's call)."""

from __future__ import annotations

from tokenserve.config import KVTransferConfig
from tokenserve.kv_transfer.base import KVConnectorScheduler
from tokenserve.kv_transfer.offloading import OffloadingConnectorScheduler
from tokenserve.kv_transfer.p2p import P2pConnectorScheduler
from tokenserve.kv_transfer.shared_storage import SharedStorageConnectorScheduler


def create_scheduler_connector(config: KVTransferConfig, block_size: int) -> KVConnectorScheduler:
    if config.kv_connector == "SharedStorageConnector":
        return SharedStorageConnectorScheduler(config, block_size)
    if config.kv_connector == "OffloadingConnector":
        return OffloadingConnectorScheduler(config, block_size)
    if config.kv_connector == "P2pConnector":
        return P2pConnectorScheduler(config, block_size)
    raise ValueError(f"Unknown kv_connector {config.kv_connector!r}.")
