"""Which KV blocks each request holds: prefix-cache lookups, slot allocation, freeing.

The manager owns the request → block-table map and keeps the block pool's ref counts
true to it. It never decides who runs; the scheduler asks it, and it answers with
blocks or with `None` (not enough free blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenserve.core.block_hash import BlockHash, extend_block_hashes, get_hash_function
from tokenserve.core.block_pool import BlockPool, KVCacheBlock
from tokenserve.core.request import Request


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache lookups, counted in tokens."""

    queries: int = 0
    hits: int = 0

    def record(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_queried_tokens
        self.hits += num_hit_tokens


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_function(hash_algo)
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks that starts the request's tokens.

        Capped so that at least one token is left to compute: the step that computes it
        produces the logits the next token is sampled from.
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        self._update_block_hashes(request, request.num_tokens)
        max_cached_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_cached_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Give the request room for `num_new_tokens` more tokens.

        `new_computed_blocks` are prefix-cache hits to take over first (only for a
        request being admitted). `num_lookahead_tokens`: slots past those, for a draft
        model's own drafts (speculative decoding); never cached. `delay_cache_blocks`: the
        new blocks' KV arrives later (a KV connector's asynchronous load), so they are
        cached by `cache_blocks` once it has. Returns the newly
        allocated blocks, or None when the pool cannot supply them; on None nothing has
        changed.
        """
        hits = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_slots = num_tokens_after + num_lookahead_tokens
        num_new_blocks = max(0, cdiv(num_slots, self.block_size) - len(blocks) - len(hits))
        # A hit on a free (cached, unreferenced) block takes that block out of the free queue.
        num_hits_from_free_queue = sum(1 for block in hits if block.ref_cnt == 0)
        if num_new_blocks + num_hits_from_free_queue > self.block_pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None

        self.block_pool.touch(hits)
        blocks.extend(hits)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        if self.enable_caching and not request.skip_prefix_cache and not delay_cache_blocks:
            # Cache blocks as soon as their tokens are known and scheduled: a request
            # later in the same step may already reuse them.
            self._cache_full_blocks(request, min(num_tokens_after, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks up to `num_computed_tokens` in the prefix cache."""
        if self.enable_caching and not request.skip_prefix_cache:
            self._cache_full_blocks(request, min(num_computed_tokens, request.num_tokens))

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (most specific prefix evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        num_full_blocks = num_tokens // self.block_size
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        if num_full_blocks <= num_cached:
            return
        self._update_block_hashes(request, num_full_blocks * self.block_size)
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[request.request_id], request.block_hashes, num_cached, num_full_blocks
        )
        self.num_cached_blocks[request.request_id] = num_full_blocks

    def _update_block_hashes(self, request: Request, num_tokens: int) -> list[BlockHash]:
        extend_block_hashes(
            self.hash_fn,
            request.block_hashes,
            request.all_token_ids[:num_tokens],
            self.block_size,
            request.cache_salt,
            request.lora_request.block_hash_key if request.lora_request else None,
            [(f.offset, f.length, f.identifier) for f in request.mm_features or ()],
        )
        return request.block_hashes
