"""The scheduler's side of a KV connector: the few calls `Scheduler` makes into it.

At admission, tokens an external store holds past the local prefix-cache hit count as
computed. A synchronous load (a store on this host) happens in the admitting step, before
its forward. An asynchronous one (a peer, P/D) gets the request's blocks and leaves it
waiting (WAITING_FOR_REMOTE_KVS) while other requests run; once the workers report it
landed, its blocks enter the prefix cache and it is admitted with them. Blocks under a
copy are never freed or reused: a request that ends while its KV is being loaded, or
whose KV a peer is still to fetch, keeps its blocks until the workers report the copy
done. A load that fails ends its request (asynchronous) or makes it start over without
its blocks in the prefix cache (synchronous: its step already ran on them).
"""

from __future__ import annotations

from tokenserve.core.kv_cache_manager import KVCacheManager, cdiv
from tokenserve.core.request import Request, RequestStatus
from tokenserve.kv_transfer.base import KVConnectorScheduler, ScheduledRequest
from tokenserve.messages.model_runner_output import KVConnectorOutput


class SchedulerConnectorHooks:
    def __init__(self, connector: KVConnectorScheduler, kv_cache_manager: KVCacheManager) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        # Requests waiting for an asynchronous load → their computed tokens once it lands.
        self.loading: dict[str, int] = {}
        # Requests whose asynchronous load landed, to be admitted with the blocks they hold.
        self.loaded: set[str] = set()
        # Finished requests whose blocks stay held until the workers' copy ends.
        self.held: dict[str, Request] = {}

    @property
    def has_pending_transfers(self) -> bool:
        return bool(self.loading or self.held)

    def external_tokens(self, request: Request, num_hit_tokens: int) -> tuple[int, bool]:
        """Tokens past the local hit the connector provides, and whether asynchronously."""
        num_tokens, load_async = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        assert num_hit_tokens + num_tokens < request.num_tokens, "one token is left to compute"
        assert load_async or num_tokens % self.kv_cache_manager.block_size == 0
        return num_tokens, load_async

    def after_alloc(self, request: Request, num_hit_tokens: int, num_external_tokens: int) -> None:
        block_size = self.kv_cache_manager.block_size
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        first = num_hit_tokens // block_size
        external = block_ids[first : cdiv(num_hit_tokens + num_external_tokens, block_size)]
        self.connector.stats.external_prefix_cache_queries += request.num_tokens
        self.connector.stats.external_prefix_cache_hits += num_external_tokens
        self.connector.update_state_after_alloc(request, external, num_external_tokens)

    def wait_for_remote_kvs(self, request: Request, num_computed_tokens: int) -> None:
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = num_computed_tokens

    def is_loaded(self, request: Request) -> bool:
        """Whether the request's blocks hold its remote KV (it is admitted with them)."""
        return request.request_id in self.loaded

    def admitted(self, request: Request, num_hit_tokens: int, num_external_tokens: int) -> None:
        if request.request_id in self.loaded:
            self.loaded.discard(request.request_id)
        else:
            self.after_alloc(request, num_hit_tokens, num_external_tokens)

    def build_metadata(
        self, scheduled: list[Request], num_scheduled_tokens: dict[str, int]
    ) -> object:
        """The step's metadata; `scheduled` have already advanced by their scheduled tokens."""
        return self.connector.build_connector_meta(
            [
                ScheduledRequest(
                    request,
                    self.kv_cache_manager.get_block_ids(request.request_id),
                    request.num_computed_tokens - num_scheduled_tokens[request.request_id],
                    request.num_computed_tokens,
                )
                for request in scheduled
            ]
        )

    def take_output(
        self, output: KVConnectorOutput | None, requests: dict[str, Request]
    ) -> tuple[set[str], set[str]]:
        """Count the workers' copies, release blocks whose copy ended, admit landed loads.
        Returns the running requests whose (synchronous) load failed and the waiting ones
        whose asynchronous load failed."""
        if output is None:
            return set(), set()
        stats = self.connector.stats
        stats.bytes_loaded += output.bytes_loaded
        stats.seconds_loaded += output.seconds_loaded
        stats.bytes_saved += output.bytes_saved
        stats.seconds_saved += output.seconds_saved
        stats.corrupt_blocks += output.corrupt_blocks
        stats.failed_loads += len(output.failed_recving)
        for request_id in output.finished_sending:
            self._release(request_id)
        failed_running, failed_waiting = set(), set()
        for request_id in output.finished_recving | output.failed_recving:
            num_computed_tokens = self.loading.pop(request_id, None)
            if request_id in self.held:
                self._release(request_id)  # ended while its KV was loading
                continue
            request = requests.get(request_id)
            if request is None:
                continue
            if request_id in output.failed_recving:
                if num_computed_tokens is None:
                    failed_running.add(request_id)
                else:
                    failed_waiting.add(request_id)
            elif num_computed_tokens is not None:
                request.num_computed_tokens = num_computed_tokens
                self.kv_cache_manager.cache_blocks(request, num_computed_tokens)
                request.status = RequestStatus.WAITING
                self.loaded.add(request_id)
        return failed_running, failed_waiting

    def finished(self, request: Request) -> tuple[bool, dict | None]:
        """A request ends. Returns whether its blocks stay held (a copy of them is still
        under way or to come) and the `kv_transfer_params` for its output."""
        self.loaded.discard(request.request_id)
        hold, params = self.connector.request_finished(
            request, self.kv_cache_manager.get_block_ids(request.request_id)
        )
        hold = hold or request.request_id in self.loading
        if hold:
            self.held[request.request_id] = request
        return hold, params

    def forget_blocks(self, request: Request) -> None:
        """Drop the request's blocks from the prefix cache: their KV cannot be trusted."""
        block_pool = self.kv_cache_manager.block_pool
        for block_id in self.kv_cache_manager.get_block_ids(request.request_id):
            block_pool.uncache(block_pool.blocks[block_id])
        self.kv_cache_manager.num_cached_blocks.pop(request.request_id, None)

    def _release(self, request_id: str) -> None:
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv_cache_manager.free(request)
