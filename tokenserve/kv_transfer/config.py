"""`--kv-transfer-config` (vLLM's keys) → a validated `KVTransferConfig` (ValueError naming
the key otherwise)."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from tokenserve.config import KV_ROLES, CacheConfig, KVTransferConfig, ModelConfig

# Connectors by `kv_connector` name (factory.py, worker_factory.py build them).
KV_CONNECTORS = ("SharedStorageConnector", "P2pConnector", "OffloadingConnector")
GIB = 1 << 30
# Where P2pConnector peers find their shared secret when the extra config has none.
SECRET_ENV = "TOKENSERVE_KV_SECRET"
KNOWN_KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_port", "kv_connector_extra_config")


def parse_kv_transfer_config_json(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--kv-transfer-config must be a JSON object: {error}.") from None
    if not isinstance(value, dict):
        message = f"--kv-transfer-config must be a JSON object, got {text!r}."
        raise ValueError(message)  # noqa: TRY004
    return value


def create_kv_transfer_config(
    values: dict[str, Any] | str | None, layout_key: str
) -> KVTransferConfig | None:
    """`layout_key`: what the KV depends on beyond block hashes (engine_args.py makes it)."""
    if values is None:
        return None
    if isinstance(values, str):
        values = parse_kv_transfer_config_json(values)
    if not isinstance(values, dict):
        raise ValueError(f"kv_transfer_config must be a dict, got {type(values).__name__}.")  # noqa: TRY004
    unknown = sorted(set(values) - set(KNOWN_KEYS))
    if unknown:
        raise ValueError(
            f"kv_transfer_config has unknown keys {unknown}; known: {list(KNOWN_KEYS)}."
        )
    name = values.get("kv_connector")
    if name not in KV_CONNECTORS:
        raise ValueError(f"kv_connector must be one of {list(KV_CONNECTORS)}, got {name!r}.")
    role = values.get("kv_role", "kv_both")
    if role not in KV_ROLES:
        raise ValueError(f"kv_role must be one of {list(KV_ROLES)}, got {role!r}.")
    port = values.get("kv_port", 14579)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"kv_port must be a port number, got {port!r}.")
    ip = values.get("kv_ip", "127.0.0.1")
    if not isinstance(ip, str) or not ip:
        raise ValueError(f"kv_ip must be an address, got {ip!r}.")
    extra = values.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"kv_connector_extra_config must be an object, got {extra!r}.")  # noqa: TRY004
    extra = dict(extra)
    if name == "SharedStorageConnector":
        _check_shared_storage(extra)
    elif name == "P2pConnector":
        _check_p2p(extra)
    else:
        size = extra.get("kv_offloading_size")
        if not _positive_number(size):
            raise ValueError(f"kv_offloading_size must be a positive number of GiB, got {size!r}.")
    return KVTransferConfig(name, role, ip, port, extra, layout_key)


def _check_shared_storage(extra: dict[str, Any]) -> None:
    path = extra.get("shared_storage_path")
    if not isinstance(path, str) or not path:
        raise ValueError(
            "SharedStorageConnector needs kv_connector_extra_config.shared_storage_path "
            f"(a directory), got {path!r}."
        )
    size = extra.get("max_size_gb")
    if size is not None and not _positive_number(size):
        raise ValueError(f"max_size_gb must be a positive number of GiB, got {size!r}.")


def _check_p2p(extra: dict[str, Any]) -> None:
    """Peers authenticate every message with a shared secret: one is required."""
    secret = extra.get("secret") or os.environ.get(SECRET_ENV)
    if not isinstance(secret, str) or len(secret) < 16:
        raise ValueError(
            "P2pConnector needs a shared secret of at least 16 characters: "
            f"kv_connector_extra_config.secret or ${SECRET_ENV}."
        )
    extra["secret"] = secret
    for key in ("send_timeout_s", "transfer_timeout_s"):
        value = extra.get(key)
        if value is not None and not _positive_number(value):
            raise ValueError(f"{key} must be a positive number of seconds, got {value!r}.")


def kv_transfer_config_for(
    values: dict[str, Any] | str | None,
    model_config: ModelConfig,
    cache_config: CacheConfig,
    kv_offloading_size: float | None = None,
) -> KVTransferConfig | None:
    """The engine's connector config: `values` checked against the model and the cache,
    or the OffloadingConnector `--kv-offloading-size` (GiB) asks for (vLLM's flag).
    KV from one model, dtype or block shape never reaches another (the layout key)."""
    if kv_offloading_size is not None:
        if values is not None:
            raise ValueError(
                "kv_offloading_size and kv_transfer_config: one KV connector at a time."
            )
        values = {"kv_connector": "OffloadingConnector",
                  "kv_connector_extra_config": {"kv_offloading_size": kv_offloading_size}}
    if values is None:
        return None
    if model_config.runner != "generate" or model_config.is_encoder_only:
        raise ValueError("kv_transfer_config needs a generate model: pooling keeps no KV to move.")
    if not cache_config.enable_prefix_caching:
        raise ValueError(
            "kv_transfer_config needs prefix caching: blocks are stored and found by block hash."
        )
    layout = "|".join(
        str(part)
        for part in (
            model_config.model,
            model_config.architecture,
            cache_config.dtype,
            model_config.num_layers,
            model_config.num_kv_heads,
            model_config.head_dim,
            cache_config.block_size,
            cache_config.prefix_caching_hash_algo,
        )
    )
    config = create_kv_transfer_config(values, hashlib.sha256(layout.encode()).hexdigest()[:16])
    if config is not None and config.kv_connector == "OffloadingConnector":
        block_bytes = model_config.kv_bytes_per_token(cache_config.dtype) * cache_config.block_size
        num_slots = int(float(config.kv_connector_extra_config["kv_offloading_size"]) * GIB)
        num_slots //= block_bytes
        if num_slots < 1:
            raise ValueError(
                f"kv_offloading_size holds no block: a block takes {block_bytes} bytes."
            )
        config.kv_connector_extra_config["num_slots"] = num_slots
    return config


def _positive_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and value > 0
