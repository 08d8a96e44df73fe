"""Checks of the block-pool invariants that DESIGN.md promises, shared by the core tests."""

from __future__ import annotations

from collections import Counter

from tokenserve.core.kv_cache_manager import KVCacheManager


def check_block_pool_invariants(manager: KVCacheManager) -> None:
    pool = manager.block_pool
    holders = Counter(
        block.block_id for blocks in manager.req_to_blocks.values() for block in blocks
    )
    free_ids = [block.block_id for block in pool.free_block_queue]
    assert len(free_ids) == len(set(free_ids)), "a block is twice in the free queue"
    assert len(free_ids) == pool.num_free_blocks
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], f"{block}: held {holders[block.block_id]} times"
        is_free = block.block_id in set(free_ids)
        assert is_free == (block.ref_cnt == 0), f"{block} free={is_free}"
    assert pool.num_free_blocks + sum(1 for b in pool.blocks if b.ref_cnt > 0) == pool.num_blocks
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    for request_id, blocks in manager.req_to_blocks.items():
        assert len({b.block_id for b in blocks}) == len(blocks), f"{request_id} holds a block twice"
