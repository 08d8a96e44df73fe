"""Hashes of full KV blocks, chained so that equal hashes mean equal prefixes.

A block's hash covers its parent's hash, its own token ids and the extra keys that
change the KV beyond the tokens (`cache_salt`, on the first block only; the LoRA
adapter's key, on every block; the hash of each image whose placeholders overlap the block).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

BlockHash = bytes

HASH_FUNCTIONS: dict[str, Callable[[bytes], bytes]] = {
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "blake2b": lambda data: hashlib.blake2b(data, digest_size=32).digest(),
}

_ROOT_HASH = b"\x00" * 32


def get_hash_function(name: str) -> Callable[[bytes], bytes]:
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"prefix_caching_hash_algo must be one of {sorted(HASH_FUNCTIONS)}, got {name!r}."
        ) from None


def hash_block(
    hash_fn: Callable[[bytes], bytes],
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[str] = (),
) -> BlockHash:
    parts = [parent_hash or _ROOT_HASH, array("q", token_ids).tobytes()]
    for key in extra_keys:
        encoded = key.encode()
        # Length-prefixed so that two keys can never run together into a third.
        parts.append(len(encoded).to_bytes(8, "little") + encoded)
    return hash_fn(b"".join(parts))


def extend_block_hashes(
    hash_fn: Callable[[bytes], bytes],
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    lora_key: str | None = None,
    mm_spans: Sequence[tuple[int, int, str]] = (),
) -> None:
    """Append the hashes of every full block of `token_ids` not hashed yet.

    `mm_spans`: (offset, length, content hash) of each image's placeholders, in prompt
    order; a block's KV depends on the images its positions embed."""
    num_full_blocks = len(token_ids) // block_size
    for index in range(len(block_hashes), num_full_blocks):
        start = index * block_size
        parent = block_hashes[-1] if block_hashes else None
        extra: tuple[str, ...] = (cache_salt,) if index == 0 and cache_salt else ()
        mm_keys = tuple(
            f"mm:{identifier}"
            for offset, length, identifier in mm_spans
            if offset < start + block_size and offset + length > start
        )
        if lora_key or mm_keys:
            # The first block's salt slot is always there with an adapter or an image (""
            # without a salt), so that a salt can never spell their keys.
            extra = ((extra or ("",)) if index == 0 else ()) + ((lora_key,) if lora_key else ())
            extra += mm_keys
        block_hashes.append(
            hash_block(hash_fn, parent, token_ids[start : start + block_size], extra)
        )
