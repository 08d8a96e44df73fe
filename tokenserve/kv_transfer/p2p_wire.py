"""The P2P connector's messages: JSON headers and raw KV bytes, each message signed with
HMAC-SHA256 under the peers' shared secret (an unsigned or altered message is refused).
A reply is signed together with the request's nonce, so it cannot answer another request.
Not encrypted: KV crosses the network in the clear (run it on a trusted network)."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any


def sign(secret: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.digest()


def verify(secret: bytes, mac: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(sign(secret, *parts), mac)


def encode(header: dict[str, Any]) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None
