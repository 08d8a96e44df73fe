"""KV blocks as files in a directory: one file per block hash, checksummed, written
atomically, bounded in size with least-recently-used eviction.

Layout: `<root>/<layout key>/<hash[:2]>/<hash>.kv`. The layout key (model, dtype, block
shape: `KVTransferConfig.kv_layout_key`) keeps different models apart in one directory;
the block hash already carries the cache salt and the adapter, so tenants stay apart.
A file is `MAGIC | sha256(payload) | len(payload) | payload`: a torn or altered file
fails the check and is ignored (and removed), never served. Writes go to a temporary
name and are renamed into place, so readers see a whole file or none, and several
instances on one host can share the directory. A reader about to load a block pins it
with a hard link, so an eviction (an unlink) by another instance cannot take it away
between the check and the load.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import uuid
from pathlib import Path

MAGIC = b"TSKVBLK1"
_HEADER = struct.Struct("<8s32sQ")
# After an eviction the store is brought down to this fraction of its limit, so that a
# full store does not rescan its directory on every write.
_LOW_WATER = 0.9


class BlockFileStore:
    def __init__(self, root: str | Path, layout_key: str, max_bytes: int | None) -> None:
        self.directory = Path(root) / layout_key
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        # Pins of this process (hard links), removed once loaded or at shutdown.
        self.pin_directory = Path(root) / ".pins" / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.num_corrupt = 0
        self._approx_bytes = self._scan_bytes() if max_bytes is not None else 0

    def path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.directory / name[:2] / f"{name}.kv"

    def contains(self, block_hash: bytes) -> bool:
        return self.path(block_hash).exists()

    def pin(self, block_hash: bytes) -> Path | None:
        """Check the block's file and hard-link it for a later `load`; None when it is
        missing or fails its check (a failing file is counted and removed)."""
        path = self.path(block_hash)
        pinned = self.pin_directory / path.name
        try:
            self.pin_directory.mkdir(parents=True, exist_ok=True)
            if pinned.exists():
                pinned.unlink()
            os.link(path, pinned)
        except FileNotFoundError:
            return None
        if self._read_verified(pinned) is None:
            self._discard_corrupt(path)
            pinned.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # most recently used
        except FileNotFoundError:
            pass  # evicted by another instance meanwhile: the pin still holds the data
        return pinned

    def load(self, pinned: Path) -> bytes | None:
        """A pinned block's payload (checked again), and the pin released. A payload that
        fails now was altered in place: its file goes too, if it is still the same one."""
        try:
            payload = self._read_verified(pinned)
            if payload is None:
                path = self.directory / pinned.name[:2] / pinned.name
                if path.exists() and os.path.samefile(path, pinned):
                    self._discard_corrupt(path)
            return payload
        finally:
            pinned.unlink(missing_ok=True)

    def unpin(self, pinned: Path) -> None:
        pinned.unlink(missing_ok=True)

    def save(self, block_hash: bytes, payload: bytes) -> int:
        """Store a block (unless present); returns the bytes written."""
        path = self.path(block_hash)
        if path.exists():
            return 0
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        data = _HEADER.pack(MAGIC, hashlib.sha256(payload).digest(), len(payload)) + payload
        with open(temporary, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
        self._approx_bytes += len(data)
        if self.max_bytes is not None and self._approx_bytes > self.max_bytes:
            self.evict()
        return len(data)

    def evict(self) -> None:
        """Remove least recently used blocks (by modification time, which a hit renews)
        until the store is under its low-water mark. Another instance's files count too."""
        assert self.max_bytes is not None
        files = []
        for path in self.directory.glob("*/*.kv"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        target = int(self.max_bytes * _LOW_WATER)
        for _, size, path in sorted(files, key=lambda item: item[0]):
            if total <= target:
                break
            path.unlink(missing_ok=True)
            total -= size
        self._approx_bytes = total

    def shutdown(self) -> None:
        shutil.rmtree(self.pin_directory, ignore_errors=True)

    def _read_verified(self, path: Path) -> bytes | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if len(data) < _HEADER.size:
            self.num_corrupt += 1
            return None
        magic, digest, length = _HEADER.unpack_from(data)
        payload = data[_HEADER.size :]
        if magic != MAGIC or length != len(payload) or hashlib.sha256(payload).digest() != digest:
            self.num_corrupt += 1
            return None
        return payload

    def _discard_corrupt(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def _scan_bytes(self) -> int:
        total = 0
        for path in self.directory.glob("*/*.kv"):
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                continue
        return total
