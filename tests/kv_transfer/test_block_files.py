"""BlockFileStore: whole files or none, checked on every read, bounded by LRU eviction,
a pinned block readable after another instance evicts it."""

from __future__ import annotations

import os
import time

from tokenserve.kv_transfer.block_files import BlockFileStore


def key(i: int) -> bytes:
    return bytes([i]) * 32


def test_round_trip_and_no_temporary_left(tmp_path):
    store = BlockFileStore(tmp_path, "layout", None)
    assert store.save(key(1), b"x" * 1000) > 1000
    assert store.save(key(1), b"x" * 1000) == 0  # already there
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [f"{key(1).hex()}.kv"]
    pinned = store.pin(key(1))
    assert pinned is not None and store.load(pinned) == b"x" * 1000
    assert not pinned.exists()
    assert store.pin(key(2)) is None


def test_other_layouts_see_nothing(tmp_path):
    BlockFileStore(tmp_path, "model-a", None).save(key(1), b"a" * 10)
    assert BlockFileStore(tmp_path, "model-b", None).pin(key(1)) is None


def test_altered_or_torn_files_are_refused_counted_and_removed(tmp_path):
    store = BlockFileStore(tmp_path, "layout", None)
    for i in (1, 2, 3):
        store.save(key(i), bytes(range(256)) * 4)
    altered = store.path(key(1))
    data = bytearray(altered.read_bytes())
    data[100] ^= 1
    altered.write_bytes(bytes(data))
    torn = store.path(key(2))
    torn.write_bytes(torn.read_bytes()[:-7])
    assert store.pin(key(1)) is None and store.pin(key(2)) is None
    assert store.num_corrupt == 2
    assert not altered.exists() and not torn.exists()
    assert store.pin(key(3)) is not None


def test_least_recently_used_blocks_are_evicted_past_the_limit(tmp_path):
    payload = b"p" * 10_000
    store = BlockFileStore(tmp_path, "layout", max_bytes=35_000)
    for i in range(3):
        store.save(key(i), payload)
        os.utime(store.path(key(i)), (time.time() - 100 + i, time.time() - 100 + i))
    pinned = store.pin(key(0))  # a hit: block 0 becomes the most recently used
    assert pinned is not None
    store.save(key(3), payload)  # past the limit: block 1 (least recently used) goes
    assert not store.contains(key(1))
    assert store.contains(key(0)) and store.contains(key(3))
    # Another instance evicting a pinned block does not take it from the reader.
    store.path(key(0)).unlink()
    assert store.load(pinned) == payload
