"""Prometheus counters of a KV connector: external prefix-cache queries and hits (vLLM's
names), and the bytes and seconds its workers loaded and saved."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenserve.messages.engine_core import KVConnectorStats

# Metric name suffix → (KVConnectorStats field, help text).
_COUNTERS = {
    "external_prefix_cache_queries": (
        "external_prefix_cache_queries",
        "Prompt tokens looked up in the KV connector's store (at admission).",
    ),
    "external_prefix_cache_hits": (
        "external_prefix_cache_hits",
        "Prompt tokens found in the KV connector's store and loaded instead of computed.",
    ),
    "kv_connector_bytes_loaded": ("bytes_loaded", "Bytes of KV the connector loaded."),
    "kv_connector_load_seconds": ("seconds_loaded", "Seconds the connector spent loading KV."),
    "kv_connector_bytes_saved": ("bytes_saved", "Bytes of KV the connector saved or sent."),
    "kv_connector_save_seconds": ("seconds_saved", "Seconds the connector spent saving KV."),
    "kv_connector_corrupt_blocks": (
        "corrupt_blocks",
        "Stored KV blocks found torn or corrupt (ignored, never served).",
    ),
    "kv_connector_failed_loads": (
        "failed_loads",
        "Requests whose KV load failed (recomputed, or ended with an error).",
    ),
}


class KVConnectorMetrics:
    def __init__(self, counter: Callable[[str, str], Any]) -> None:
        self.counters = {field: counter(name, doc) for name, (field, doc) in _COUNTERS.items()}
        # The engine core's counters are cumulative; these turn them into increments.
        self.last: dict[str, float] = dict.fromkeys(self.counters, 0)

    def record(self, stats: KVConnectorStats) -> None:
        for field, metric in self.counters.items():
            value = getattr(stats, field)
            if value > self.last[field]:
                metric.inc(value - self.last[field])
            self.last[field] = value
