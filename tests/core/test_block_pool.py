from __future__ import annotations

import pytest

from tokenserve.core.block_hash import extend_block_hashes, get_hash_function
from tokenserve.core.block_pool import BlockPool
from tokenserve.core.kv_cache_manager import KVCacheManager
from tokenserve.core.request import Request
from tokenserve.sampling_params import SamplingParams

from .invariants import check_block_pool_invariants


def make_request(request_id: str, token_ids: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=4), eos_token_id=None, cache_salt=cache_salt)


def test_new_blocks_come_from_the_lru_head_and_evict_their_hash():
    pool = BlockPool(4, enable_caching=True)
    first = pool.get_new_blocks(2)
    pool.cache_full_blocks(first, [b"h0", b"h1"], 0, 2)
    pool.free_blocks(reversed(first))  # tail first: block 1 is freed before block 0
    assert [b.block_id for b in pool.free_block_queue] == [2, 3, 1, 0]
    assert pool.get_cached_block(b"h1") is first[1]  # a free block keeps its hash
    taken = pool.get_new_blocks(3)
    assert [b.block_id for b in taken] == [2, 3, 1]
    assert pool.get_cached_block(b"h1") is None  # evicted on reuse
    assert pool.get_cached_block(b"h0") is first[0]


def test_a_freed_block_without_a_hash_is_handed_out_before_blocks_never_used():
    pool = BlockPool(6, enable_caching=True)
    first = pool.get_new_blocks(3)
    pool.cache_full_blocks(first, [b"h0", b"h1"], 0, 2)  # block 2: a partial last block
    second = pool.get_new_blocks(1)  # block 3: a duplicate of a cached one, never hashed
    pool.cache_full_blocks(second, [b"h0"], 0, 1)
    pool.free_blocks(reversed(first))
    pool.free_blocks(second)
    # Uncached blocks at the head, the last freed first; cached ones at the tail in LRU order.
    assert [b.block_id for b in pool.free_block_queue] == [3, 2, 4, 5, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(4)] == [3, 2, 4, 5]
    assert pool.get_cached_block(b"h0") is first[0] and pool.get_cached_block(b"h1") is first[1]


def test_without_prefix_caching_a_request_gets_the_blocks_the_last_one_freed():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    first = make_request("a", list(range(10)))
    assert manager.allocate_slots(first, 10) is not None
    held = [block.block_id for block in manager.req_to_blocks["a"]]
    manager.free(first)
    second = make_request("b", list(range(100, 111)))
    assert manager.allocate_slots(second, 11) is not None
    # The same memory, in the same order, before any block never written.
    assert [block.block_id for block in manager.req_to_blocks["b"]] == held
    check_block_pool_invariants(manager)
    manager.free(second)
    check_block_pool_invariants(manager)


def test_touch_takes_a_cached_free_block_out_of_the_free_queue():
    pool = BlockPool(3, enable_caching=True)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [b"h"], 0, 1)
    pool.free_blocks([block])
    pool.touch([block])
    assert block.ref_cnt == 1
    assert block.block_id not in [b.block_id for b in pool.free_block_queue]
    assert pool.num_free_blocks == 2


def test_block_hash_chain_depends_on_parent_tokens_and_salt():
    hash_fn = get_hash_function("sha256")
    a: list[bytes] = []
    b: list[bytes] = []
    c: list[bytes] = []
    extend_block_hashes(hash_fn, a, [1, 2, 3, 4, 5, 6, 7, 8], 4, None)
    extend_block_hashes(hash_fn, b, [9, 2, 3, 4, 5, 6, 7, 8], 4, None)
    extend_block_hashes(hash_fn, c, [1, 2, 3, 4, 5, 6, 7, 8], 4, "tenant")
    assert len(a) == 2
    assert a[1] != b[1]  # same tokens in block 1, different parent
    assert a[0] != c[0] and a[1] != c[1]  # the salt changes the whole chain


def test_unknown_hash_algorithm_is_refused():
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        get_hash_function("md5")


def test_prefix_hit_leaves_at_least_one_token_to_compute():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request("a", list(range(8)))
    assert manager.allocate_slots(first, 8) is not None
    second = make_request("b", list(range(8)))
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    # 8 tokens = 2 full blocks, but the last token must be computed: only 1 block hits.
    assert num_hit_tokens == 4 and hits[0].block_id == manager.req_to_blocks["a"][0].block_id
    assert manager.allocate_slots(second, 4, hits, num_hit_tokens) is not None
    assert hits[0].ref_cnt == 2
    check_block_pool_invariants(manager)
    manager.free(first)
    manager.free(second)
    check_block_pool_invariants(manager)
    assert manager.block_pool.num_free_blocks == 8


def test_cache_salt_separates_prefixes():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    assert manager.allocate_slots(make_request("a", list(range(9)), "x"), 9) is not None
    assert manager.get_computed_blocks(make_request("b", list(range(9)), "x"))[1] == 8
    assert manager.get_computed_blocks(make_request("c", list(range(9)), "y"))[1] == 0
    assert manager.get_computed_blocks(make_request("d", list(range(9))))[1] == 0


def test_allocation_that_does_not_fit_changes_nothing():
    manager = KVCacheManager(num_blocks=2, block_size=4)
    request = make_request("a", list(range(12)))
    assert manager.allocate_slots(request, 12) is None
    assert manager.block_pool.num_free_blocks == 2
    assert "a" not in manager.req_to_blocks
    check_block_pool_invariants(manager)
