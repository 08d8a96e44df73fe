"""API keys: who may call the server, and which prefix-cache partition a caller's requests use.

With keys configured (`--api-key`, repeatable, and/or `--api-key-file`), every route but
/health and /metrics needs `Authorization: Bearer <key>` (or Basic, the key as password:
a browser's own prompt for /dashboard). The presented key is compared
with every configured key, each in constant time, so the time taken tells nothing about
how close a guess was. Unless `--shared-prefix-cache-across-keys`, a caller's requests get a
cache salt derived from its key (HMAC-SHA256 under a secret made at start-up, so the salt
reveals nothing of the key): requests under different keys never share KV blocks. A
request's own `cache_salt` is appended to its key's salt, splitting that tenant's cache
further. Keys are never logged and never reach the engine core.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Sequence

from fastapi import Request as HTTPRequest
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenserve.entrypoints.openai.errors import OpenAIError, error_json

UNGUARDED_PATHS = frozenset({"/health", "/metrics"})
# Pages a browser opens: a 401 there asks for the key with the browser's login prompt
# (any user name, the key as password), which the browser then sends with the page's fetches.
BROWSER_PATH_PREFIX = "/dashboard"
# Where the middleware leaves the caller's salt for the handlers (Starlette's request.state).
TENANT_SALT_STATE = "tenant_cache_salt"


def load_api_keys(keys: Sequence[str] | None, key_file: str | None) -> list[str]:
    """The configured keys: `keys`, then the file's lines (blank lines and # comments skipped)."""
    loaded = list(keys or [])
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as file:
                from_file = [line.strip() for line in file]
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"Cannot read the API key file {key_file}: {error}") from None
        from_file = [key for key in from_file if key and not key.startswith("#")]
        if not from_file:
            raise ValueError(f"The API key file {key_file} holds no key.")
        loaded += from_file
    for key in loaded:
        if not key.strip() or key != key.strip():
            raise ValueError("API keys must be non-empty and have no surrounding whitespace.")
    return list(dict.fromkeys(loaded))  # without duplicates, in order


class APIKeyMiddleware:
    """Refuses (401) requests without a configured key; tags the rest with their key's salt."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str], salt_per_key: bool = True) -> None:
        if not api_keys:
            raise ValueError("APIKeyMiddleware needs at least one key.")
        self.app = app
        self.salt_per_key = salt_per_key
        self._secret = secrets.token_bytes(32)
        self._key_digests = [self._digest(key) for key in api_keys]

    def _digest(self, key: str) -> bytes:
        return hmac.new(self._secret, key.encode(), hashlib.sha256).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNGUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "basic":
            # A browser's own login prompt (/dashboard): the password is the key.
            token, scheme = _basic_password(token), "bearer"
        presented = self._digest(token.strip())
        matched: bytes | None = None
        for digest in self._key_digests:  # every key, no early exit
            if hmac.compare_digest(presented, digest):
                matched = digest
        if scheme.lower() != "bearer" or matched is None:
            error = OpenAIError(401, "Invalid or missing API key.", code="invalid_api_key")
            response = error_json(error)
            if scope["path"].startswith(BROWSER_PATH_PREFIX):
                response.headers["WWW-Authenticate"] = 'Basic realm="tokenserve", charset="UTF-8"'
            await response(scope, receive, send)
            return
        if self.salt_per_key:
            scope.setdefault("state", {})[TENANT_SALT_STATE] = f"tenant-{matched[:16].hex()}"
        await self.app(scope, receive, send)


def _basic_password(credentials: str) -> str:
    try:
        decoded = base64.b64decode(credentials.strip(), validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return ""
    return decoded.partition(":")[2]


def effective_cache_salt(raw_request: HTTPRequest, request_salt: str | None) -> str | None:
    """The cache salt a request runs with: its key's salt (if any), then its own."""
    tenant_salt = raw_request.scope.get("state", {}).get(TENANT_SALT_STATE)
    if tenant_salt is None:
        return request_salt
    if request_salt is None:
        return tenant_salt
    if not request_salt:
        raise OpenAIError(400, "cache_salt must be a non-empty string.", param="cache_salt")
    # The tenant part has a fixed length, so no two (tenant, salt) pairs give one string.
    return f"{tenant_salt}:{request_salt}"
