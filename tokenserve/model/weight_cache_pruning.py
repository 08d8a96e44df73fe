"""Bounding the weight cache: a model file's least recently used entries are removed.

A weight-cache entry (model/weight_cache.py) is named `<stem>-<file id>-<key>.bin`, the file
id a digest of the GGUF file's real path; a replaced file, another dtype or new expansion
code gives the same file a new key, and nothing would ever read the old entry again. When
an entry is written, the file's other entries beyond the `MAX_ENTRIES_PER_FILE` most
recently used are removed, except any used within `RECENT_SECONDS` (two installs, or a
float32 and a bf16 server, taking turns on one file keep theirs). A hit marks its entry
used (its mtime; the checksums, not the mtime, vouch for the contents). Removing an entry
another process has mapped is safe: its mapping keeps the data until it is unmapped, and
a reader that finds the name gone expands the weights again. Temporary files of writers
that died (`.partial-*`, untouched for `RECENT_SECONDS`) go as well.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

MAX_ENTRIES_PER_FILE = 3
RECENT_SECONDS = 3600.0
_PARTIAL_PREFIX = ".partial-"


def mark_used(entry: str) -> None:
    """Record a hit on `entry` (its mtime), for the least-recently-used order."""
    try:
        os.utime(entry)
    except OSError:
        pass  # a read-only cache still serves; it is just never pruned by use


def prune(entry: str) -> list[str]:
    """Remove the entries of `entry`'s model file (other keys) beyond the bound, and dead
    writers' temporary files; returns the paths removed."""
    directory, name = os.path.split(entry)
    group = name.rsplit("-", 1)[0] + "-"  # "<stem>-<file id>-"
    now = time.time()
    others, removed = [], []
    try:
        listing = list(os.scandir(directory))
    except OSError:
        return removed
    for item in listing:
        try:
            mtime = item.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue  # removed meanwhile
        if item.name.startswith(_PARTIAL_PREFIX):
            if now - mtime > RECENT_SECONDS:
                removed.append(item.path)
        elif item.name.startswith(group) and item.name.endswith(".bin") and item.name != name:
            others.append((mtime, item.path))
    # The new entry counts as the most recent one.
    others.sort(reverse=True)
    for mtime, path in others[MAX_ENTRIES_PER_FILE - 1:]:
        if now - mtime > RECENT_SECONDS:
            removed.append(path)
    for path in removed:
        try:
            os.remove(path)
            logger.info("Weight cache: removed %s (least recently used).", path)
        except OSError:
            pass
    return removed
