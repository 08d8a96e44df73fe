"""An image's content hash: the same pixels, mode and size always give the same hash.

It keys the encoder cache (a repeated image is encoded once) and enters the block hashes of
the blocks its placeholders fill (the same text with another image never shares KV).
"""

from __future__ import annotations

import hashlib

from PIL import Image


def hash_image(image: Image.Image) -> str:
    hasher = hashlib.blake2b(digest_size=32)
    header = f"{image.mode}:{image.width}x{image.height}:"
    hasher.update(header.encode())
    hasher.update(image.tobytes())
    return hasher.hexdigest()
