"""Where tokenserve keeps files it derives once and reuses: converted tokenizers, compiled
kernels, expanded GGUF weights. `$TOKENSERVE_CACHE_DIR`, or ~/.cache/tokenserve."""

from __future__ import annotations

import os

CACHE_DIR_ENV = "TOKENSERVE_CACHE_DIR"


def cache_root() -> str:
    return os.path.expanduser(os.environ.get(CACHE_DIR_ENV) or os.path.join("~", ".cache", "tokenserve"))
