"""The worker side of the connector `kv_connector` names (the model runner's call)."""

from __future__ import annotations

from tokenserve.config import KVTransferConfig
from tokenserve.kv_transfer.offloading_worker import OffloadingConnectorWorker
from tokenserve.kv_transfer.p2p_worker import P2pConnectorWorker
from tokenserve.kv_transfer.shared_storage_worker import SharedStorageConnectorWorker
from tokenserve.kv_transfer.worker_base import KVConnectorWorker


def create_worker_connector(config: KVTransferConfig) -> KVConnectorWorker:
    if config.kv_connector == "SharedStorageConnector":
        return SharedStorageConnectorWorker(config)
    if config.kv_connector == "OffloadingConnector":
        return OffloadingConnectorWorker(config)
    if config.kv_connector == "P2pConnector":
        return P2pConnectorWorker(config)
    raise ValueError(f"Unknown kv_connector {config.kv_connector!r}.")
