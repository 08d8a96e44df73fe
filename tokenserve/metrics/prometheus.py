"""Prometheus metrics with vLLM's names under a `tokenserve:` prefix.

Gauges mirror the engine core's latest scheduler stats; counters and histograms
accumulate the API process's per-iteration stats. Metrics live in their own registry,
served by the API server at /metrics.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenserve.messages.engine_core import SchedulerStats, SpecDecodingStats
from tokenserve.metrics.kv_connector_metrics import KVConnectorMetrics
from tokenserve.metrics.stats import IterationStats

PREFIX = "tokenserve:"
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISH_REASONS = ("stop", "length", "abort")
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class PrometheusStatLogger:
    """One set of metric families; each data-parallel engine's samples carry its `engine`
    label (vLLM's `engine="0"`, ...), bound for every engine from the start."""

    def __init__(
        self, model_name: str, registry: CollectorRegistry | None = None, num_engines: int = 1
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name", "engine"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry)

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        families = {
            "num_requests_running": gauge("num_requests_running", "Requests in the running batch."),
            "num_requests_waiting": gauge("num_requests_waiting", "Requests waiting to run."),
            "kv_cache_usage": gauge(
                "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)."
            ),
            "prefix_cache_queries": counter(
                "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
            ),
            "prefix_cache_hits": counter(
                "prefix_cache_hits", "Prompt tokens found in the prefix cache."
            ),
            "num_preemptions": counter("num_preemptions", "Preemptions of running requests."),
            "token_budget": gauge(
                "token_budget",
                "Token budget of the latest engine step: max_num_batched_tokens, or under "
                "--target-step-ms its decode rows plus the prompt tokens the target leaves room for.",
            ),
            "predicted_step_time": gauge(
                "predicted_step_time_seconds",
                "The step-cost model's prediction for the latest engine step (--target-step-ms).",
            ),
            "prompt_tokens": counter("prompt_tokens", "Prompt tokens processed."),
            "generation_tokens": counter("generation_tokens", "Tokens generated."),
            "time_to_first_token": histogram(
                "time_to_first_token_seconds", "Time from arrival to the first token.", _LATENCY_BUCKETS
            ),
            "inter_token_latency": histogram(
                "inter_token_latency_seconds",
                "Time between two outputs of a request.",
                _LATENCY_BUCKETS,
            ),
            "e2e_request_latency": histogram(
                "e2e_request_latency_seconds", "Time from arrival to the last token.", _REQUEST_BUCKETS
            ),
            "request_queue_time": histogram(
                "request_queue_time_seconds",
                "Time from arrival to first being scheduled.",
                _REQUEST_BUCKETS,
            ),
            "iteration_tokens": histogram(
                "iteration_tokens_total", "Tokens computed by one engine step.", _TOKEN_BUCKETS
            ),
            "spec_decode_num_drafts": counter(
                "spec_decode_num_drafts", "Draft runs verified (one per request and step)."
            ),
            "spec_decode_num_draft_tokens": counter(
                "spec_decode_num_draft_tokens", "Draft tokens verified."
            ),
            "spec_decode_num_accepted_tokens": counter(
                "spec_decode_num_accepted_tokens", "Draft tokens accepted."
            ),
        }
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests that finished, by finish reason.",
            ["model_name", "engine", "finished_reason"],
            registry=self.registry,
        )
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0: the first).",
            ["model_name", "engine", "position"],
            registry=self.registry,
        )
        self.engines = [
            _EngineMetrics(
                str(index),
                {name: family.labels(model_name, str(index)) for name, family in families.items()},
            )
            for index in range(num_engines)
        ]
        for engine in self.engines:
            for reason in FINISH_REASONS:
                self.request_success.labels(model_name, engine.label, reason)
        # The KV connector's counters (kv_transfer/), one family each, per engine.
        kv_families: dict[str, Any] = {}

        def kv_counter(index: int) -> Any:
            def labelled(name: str, doc: str) -> Any:
                if name not in kv_families:
                    kv_families[name] = counter(name, doc)
                return kv_families[name].labels(model_name, str(index))

            return labelled

        self.kv_connectors = [KVConnectorMetrics(kv_counter(index)) for index in range(num_engines)]

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats
    ) -> None:
        engine = self.engines[iteration_stats.engine_index]
        if scheduler_stats is not None:
            engine.metrics["num_requests_running"].set(scheduler_stats.num_running_reqs)
            engine.metrics["num_requests_waiting"].set(scheduler_stats.num_waiting_reqs)
            engine.metrics["kv_cache_usage"].set(scheduler_stats.kv_cache_usage)
            if scheduler_stats.token_budget is not None:
                engine.metrics["token_budget"].set(scheduler_stats.token_budget)
            if scheduler_stats.predicted_step_ms is not None:
                engine.metrics["predicted_step_time"].set(scheduler_stats.predicted_step_ms / 1e3)
            counters = (
                scheduler_stats.prefix_cache_queries,
                scheduler_stats.prefix_cache_hits,
                scheduler_stats.num_preemptions,
            )
            for metric, new, old in zip(
                (engine.metrics["prefix_cache_queries"], engine.metrics["prefix_cache_hits"], engine.metrics["num_preemptions"]),
                counters,
                engine.last_core_counters,
            ):
                if new > old:
                    metric.inc(new - old)
            engine.last_core_counters = counters
            if scheduler_stats.spec_decoding_stats is not None:
                self._record_spec_decoding(engine, scheduler_stats.spec_decoding_stats)
            if scheduler_stats.kv_connector_stats is not None:
                self.kv_connectors[iteration_stats.engine_index].record(
                    scheduler_stats.kv_connector_stats
                )
        if iteration_stats.num_scheduled_tokens:
            engine.metrics["iteration_tokens"].observe(iteration_stats.num_scheduled_tokens)
        engine.metrics["prompt_tokens"].inc(iteration_stats.num_prompt_tokens)
        engine.metrics["generation_tokens"].inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            engine.metrics["time_to_first_token"].observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            engine.metrics["inter_token_latency"].observe(itl)
        for finished in iteration_stats.finished_requests:
            self.request_success.labels(
                self.model_name, engine.label, finished.finish_reason
            ).inc()
            engine.metrics["e2e_request_latency"].observe(finished.e2e_latency)
            if finished.queue_time is not None:
                engine.metrics["request_queue_time"].observe(finished.queue_time)

    def _record_spec_decoding(self, engine: _EngineMetrics, stats: SpecDecodingStats) -> None:
        counters = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        metrics = (
            engine.metrics["spec_decode_num_drafts"],
            engine.metrics["spec_decode_num_draft_tokens"],
            engine.metrics["spec_decode_num_accepted_tokens"],
        )
        for metric, new, old in zip(metrics, counters, engine.last_spec_counters):
            if new > old:
                metric.inc(new - old)
        engine.last_spec_counters = counters
        per_pos = stats.num_accepted_tokens_per_pos
        last = engine.last_accepted_per_pos
        last = last + [0] * (len(per_pos) - len(last))
        for position, (new, old) in enumerate(zip(per_pos, last)):
            child = self.spec_decode_num_accepted_tokens_per_pos.labels(
                self.model_name, engine.label, str(position)
            )
            if new > old:
                child.inc(new - old)
        engine.last_accepted_per_pos = list(per_pos)

    def log(self) -> None:
        """Prometheus is scraped, not logged."""

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineMetrics:
    """One engine's bound samples (by metric), and its last cumulative counters:
    the engine core's counters are cumulative, the Prometheus counters take increments."""

    def __init__(self, label: str, children: dict[str, Any]) -> None:
        self.label = label
        self.metrics = children
        self.last_core_counters: tuple[int, ...] = (0, 0, 0)
        self.last_spec_counters: tuple[int, ...] = (0, 0, 0)
        self.last_accepted_per_pos: list[int] = []
