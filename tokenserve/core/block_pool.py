"""The pool of KV cache blocks: ref counts, one LRU free queue, and the prefix-cache map.

The free queue's head is handed out first. A freed block with a hash joins the tail (the
least recently used cached block is the first evicted); a freed block without one (prefix
caching off, a request's partial last block, a duplicate of a cached block) has nothing to
evict and joins the head, ahead of the blocks never used yet. So a block pool reuses the
memory it has written before it touches new memory: on CPU the KV cache is mapped lazily
and a block's first write faults in its pages (worker/cpu_memory.py), which on some hosts
costs more than the step's compute (docs/PERFORMANCE_CPU.md).

Invariants (tests/core/test_block_pool_properties.py checks them):
- a block's `ref_cnt` equals the number of request block tables that hold it;
- a block is in the free queue exactly when its `ref_cnt` is 0;
- a free block keeps its hash (and stays findable) until it is handed out again.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenserve.core.block_hash import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, the next to hand out at the head.

    A linked list rather than a deque because a prefix-cache hit takes a block out of
    the middle of the queue, and that must be O(1).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("No free blocks left in the KV cache.")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        assert prev_block is not None and next_block is not None, f"{block} is not free"
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        self._insert(block, last, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free
        assert first is not None
        self._insert(block, self._head, first)

    def _insert(self, block: KVCacheBlock, prev_block: KVCacheBlock,
                next_block: KVCacheBlock) -> None:
        prev_block.next_free = block
        block.prev_free = prev_block
        block.next_free = next_block
        next_block.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"The KV cache needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks held by requests (free-but-cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out `num_blocks` blocks from the head of the free queue, evicting their hashes."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} blocks: only {self.num_free_blocks} free.")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks that a request reuses."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue in order:
        cached ones at its tail, uncached ones at its head (the last of them first).

        Callers pass a request's blocks tail first, so that the most specific (least
        shareable) part of a prefix is the first to be evicted, and its uncached blocks are
        handed out again in the order it held them.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int, end: int
    ) -> None:
        """Register blocks[start:end] (all full) under their hashes."""
        for block, block_hash in zip(blocks[start:end], block_hashes[start:end]):
            if block.block_hash is not None:
                continue  # Already cached (it came from a prefix-cache hit).
            if block_hash in self.cached_block_hash_to_block:
                # Another request computed the same block first; keep that one findable
                # and let this duplicate be an ordinary, uncached block.
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only possible while no block is held."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget a block's hash (its KV is not what the hash says: a failed external load)."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
