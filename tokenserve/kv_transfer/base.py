"""The scheduler side of a KV connector (vLLM V1's `KVConnectorBase_V1`, scheduler half).

The scheduler asks a connector, when it admits a request, how many tokens past the local
prefix-cache hit an external store holds (`get_num_new_matched_tokens`); after allocating
the request's blocks it tells the connector which blocks those tokens go to
(`update_state_after_alloc`); each step it asks for the step's metadata for the workers
(`build_connector_meta`: blocks to load, blocks to save); when a request finishes the
connector may keep its blocks until the workers report the copy done (`request_finished`).
No tensors here: `core` imports this module and nothing of the worker side.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from tokenserve.config import KVTransferConfig
from tokenserve.messages.engine_core import KVConnectorStats


class ConnectorRequest(Protocol):
    """What a connector reads of a request (core's `Request` has it)."""

    request_id: str
    all_token_ids: list[int]
    block_hashes: list[bytes]
    num_computed_tokens: int
    skip_prefix_cache: bool
    kv_transfer_params: dict[str, Any] | None
    # A RequestStatus; its `finish_reason` is "abort" for an aborted request.
    status: Any

    @property
    def num_tokens(self) -> int: ...


@dataclass
class KVConnectorMetadata:
    """One step's instructions for the worker side; each connector subclasses it."""


@dataclass
class ScheduledRequest:
    """A request this step computes tokens of: its blocks and how far it gets."""

    request: ConnectorRequest
    block_ids: list[int]
    # Tokens computed before this step and after it.
    num_computed_before: int
    num_computed_after: int

    def completed_blocks(self, block_size: int) -> Iterator[tuple[int, bytes]]:
        """(block id, block hash) of each full block this step completes; none for a request
        kept out of the prefix cache."""
        request = self.request
        if request.skip_prefix_cache:
            return
        first = self.num_computed_before // block_size
        last = min(self.num_computed_after, request.num_tokens) // block_size
        for index in range(first, min(last, len(request.block_hashes))):
            yield self.block_ids[index], request.block_hashes[index]


class KVConnectorScheduler(ABC):
    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        # external_prefix_cache_* counters; the worker side's bytes and seconds are added
        # by the scheduler from each step's KVConnectorOutput.
        self.stats = KVConnectorStats()

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens past `num_computed_tokens` (the local hit, block aligned) that the
        external store holds, in whole blocks, leaving at least one token to compute; and
        whether they load asynchronously (the request then waits in
        WAITING_FOR_REMOTE_KVS while other requests run)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request's blocks are allocated: remember which ones receive the external
        tokens (the blocks after the local hit)."""

    @abstractmethod
    def build_connector_meta(self, scheduled: list[ScheduledRequest]) -> KVConnectorMetadata:
        """This step's loads and saves, for the workers. Called once per step, after
        `schedule()` has advanced every scheduled request's computed count."""

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request finished. Returns whether its blocks must stay held until the workers
        report it in `finished_sending`, and the `kv_transfer_params` to return to the
        client (P/D: where the decode instance finds the KV)."""
        return False, None

    def request_aborted_while_loading(self, request: ConnectorRequest) -> None:
        """A request waiting for remote KV was aborted; its blocks stay held until the
        workers report its load finished or failed."""

    def shutdown(self) -> None:
        """Close listeners and files."""
