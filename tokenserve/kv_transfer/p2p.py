"""`P2pConnector`, scheduler side: prefill/decode disaggregation between two instances.

A request sent to a `kv_producer` (prefill) instance with `kv_transfer_params:
{"do_remote_decode": true}` keeps its blocks when it finishes; its output's
`kv_transfer_params` say where they are (host, port, request id, block ids, token count,
a digest of the tokens). A `kv_consumer` (decode) instance given those params allocates
blocks for every prompt token but the last and pulls the KV into them asynchronously
(the request waits in WAITING_FOR_REMOTE_KVS; p2p_worker.py does the transfer, ZMQ over
TCP, every message signed with the peers' shared secret). The producer frees its blocks
when the consumer has pulled them, was told to let go, or after `send_timeout_s`.
Extra config: `secret` (or `$TOKENSERVE_KV_SECRET`, read by config.py),
`send_timeout_s` (60), `transfer_timeout_s` (30).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from tokenserve.config import KVTransferConfig
from tokenserve.kv_transfer.base import (
    ConnectorRequest,
    KVConnectorMetadata,
    KVConnectorScheduler,
    ScheduledRequest,
)

logger = logging.getLogger(__name__)


@dataclass
class RemoteKV:
    """Where a prefill instance keeps a request's KV (its `kv_transfer_params`)."""

    host: str
    port: int
    request_id: str
    block_ids: list[int]
    num_tokens: int
    tokens_digest: str
    layout_key: str

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RemoteKV | None:
        try:
            remote = cls(
                str(params["remote_host"]),
                int(params["remote_port"]),
                str(params["remote_request_id"]),
                [int(block_id) for block_id in params["remote_block_ids"]],
                int(params["remote_num_tokens"]),
                str(params["remote_tokens_digest"]),
                str(params["remote_layout_key"]),
            )
        except (KeyError, TypeError, ValueError):
            return None
        return remote

    def to_params(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": self.request_id,
            "remote_block_ids": self.block_ids,
            "remote_num_tokens": self.num_tokens,
            "remote_tokens_digest": self.tokens_digest,
            "remote_layout_key": self.layout_key,
        }


@dataclass
class Pull:
    """Blocks to fetch from a peer: its block ids → ours, in order (none: just release)."""

    remote: RemoteKV
    remote_block_ids: list[int]
    local_block_ids: list[int]


@dataclass
class P2pMetadata(KVConnectorMetadata):
    # Request id → the pull a consumer's worker starts this step.
    pulls: dict[str, Pull] = field(default_factory=dict)
    # Request id → its blocks, which a producer's worker serves to the peer that asks.
    sends: dict[str, list[int]] = field(default_factory=dict)


def tokens_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(repr(list(token_ids)).encode()).hexdigest()[:32]


class P2pConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        super().__init__(config, block_size)
        extra = config.kv_connector_extra_config
        self.advertised_host = str(extra.get("advertise_host", config.kv_ip))
        self._pulls: dict[str, Pull] = {}
        self._sends: dict[str, list[int]] = {}
        # Requests whose remote KV was already pulled (or let go): never pulled twice.
        self._consumed: set[str] = set()

    def _remote(self, request: ConnectorRequest) -> RemoteKV | None:
        params = request.kv_transfer_params
        if (
            not self.config.is_consumer
            or not isinstance(params, dict)
            or not params.get("do_remote_prefill")
            or request.request_id in self._consumed
        ):
            return None
        remote = RemoteKV.from_params(params)
        if remote is None or remote.layout_key != self.config.kv_layout_key:
            logger.warning("Request %s: kv_transfer_params unusable here; computing it.",
                           request.request_id)
            return None
        if tokens_digest(request.all_token_ids[: remote.num_tokens]) != remote.tokens_digest:
            logger.warning("Request %s: its tokens differ from the prefill's; computing it.",
                           request.request_id)
            return None
        return remote

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        remote = self._remote(request)
        if remote is None:
            return 0, False
        usable = min(request.num_tokens - 1, remote.num_tokens)
        if usable <= num_computed_tokens:
            return 0, False
        return usable - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        remote = self._remote(request)
        if remote is None:
            return
        self._consumed.add(request.request_id)
        if num_external_tokens == 0:
            # Everything was cached here: the producer may let go of its blocks now.
            self._pulls[request.request_id] = Pull(remote, [], [])
            return
        end = -(-min(request.num_tokens - 1, remote.num_tokens) // self.block_size)
        remote_block_ids = remote.block_ids[end - len(block_ids) : end]
        self._pulls[request.request_id] = Pull(remote, remote_block_ids, list(block_ids))

    def build_connector_meta(self, scheduled: list[ScheduledRequest]) -> P2pMetadata:
        metadata = P2pMetadata(self._pulls, self._sends)
        self._pulls, self._sends = {}, {}
        return metadata

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._consumed.discard(request.request_id)
        params = request.kv_transfer_params
        if (
            not self.config.is_producer
            or not isinstance(params, dict)
            or not params.get("do_remote_decode")
            or getattr(request.status, "finish_reason", None) == "abort"
            or not block_ids
        ):
            return False, None
        self._sends[request.request_id] = list(block_ids)
        num_tokens = request.num_computed_tokens
        remote = RemoteKV(
            self.advertised_host,
            self.config.kv_port,
            request.request_id,
            list(block_ids),
            num_tokens,
            tokens_digest(request.all_token_ids[:num_tokens]),
            self.config.kv_layout_key,
        )
        return True, remote.to_params()
