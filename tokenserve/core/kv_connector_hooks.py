"""The scheduler's side of a KV connector: the few calls `Scheduler` makes into it.

At admission, tokens an external store holds past the local prefix-cache hit count as
computed (the worker loads them before the step's forward); each step the connector gets
the blocks every scheduled request completes (to save) and builds the workers' metadata;
after the step, a load the workers could not verify makes its request recompute from
scratch, its blocks dropped from the prefix cache so nobody reuses them.
"""

from __future__ import annotations

from tokenserve.core.kv_cache_manager import KVCacheManager
from tokenserve.core.request import Request
from tokenserve.kv_transfer.base import KVConnectorScheduler, ScheduledRequest
from tokenserve.messages.model_runner_output import KVConnectorOutput


class SchedulerConnectorHooks:
    def __init__(self, connector: KVConnectorScheduler, kv_cache_manager: KVCacheManager) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager

    def num_external_tokens(self, request: Request, num_hit_tokens: int) -> int:
        """Tokens past the local hit that the connector will load into the request's blocks."""
        num_tokens, load_async = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        assert not load_async, "asynchronous loads are not scheduled yet"
        assert num_tokens % self.kv_cache_manager.block_size == 0, "external hits are whole blocks"
        assert num_hit_tokens + num_tokens < request.num_tokens, "one token is left to compute"
        return num_tokens

    def after_alloc(self, request: Request, num_hit_tokens: int, num_external_tokens: int) -> None:
        block_size = self.kv_cache_manager.block_size
        first = num_hit_tokens // block_size
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        external = block_ids[first : first + num_external_tokens // block_size]
        self.connector.stats.external_prefix_cache_queries += request.num_tokens
        self.connector.stats.external_prefix_cache_hits += num_external_tokens
        self.connector.update_state_after_alloc(request, external, num_external_tokens)

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

    def take_output(self, output: KVConnectorOutput | None) -> set[str]:
        """Count the workers' copies; returns the requests whose load failed."""
        if output is None:
            return set()
        stats = self.connector.stats
        stats.bytes_loaded += output.bytes_loaded
        stats.seconds_loaded += output.seconds_loaded
        stats.bytes_saved += output.bytes_saved
        stats.seconds_saved += output.seconds_saved
        stats.corrupt_blocks += output.corrupt_blocks
        stats.failed_loads += len(output.failed_recving)
        return output.failed_recving

    def finished(self, request: Request) -> None:
        """A request ends; the connector releases what it held for it."""
        delay_free, _ = self.connector.request_finished(
            request, self.kv_cache_manager.get_block_ids(request.request_id)
        )
        assert not delay_free, "holding blocks after a request finishes is not scheduled yet"

    def forget_blocks(self, request: Request) -> None:
        """Drop the request's blocks from the prefix cache: their KV cannot be trusted."""
        block_pool = self.kv_cache_manager.block_pool
        for block_id in self.kv_cache_manager.get_block_ids(request.request_id):
            block_pool.uncache(block_pool.blocks[block_id])
        self.kv_cache_manager.num_cached_blocks.pop(request.request_id, None)
