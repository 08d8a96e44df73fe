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
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        # Every metric carries the served model's name; children are bound (and so
        # exported, at 0) from the start.
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(
                model_name
            )

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(
                model_name
            )

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(
                PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry
            ).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)."
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.num_preemptions = counter("num_preemptions", "Preemptions of running requests.")
        self.token_budget = gauge(
            "token_budget",
            "Token budget of the latest engine step: max_num_batched_tokens, or under "
            "--target-step-ms its decode rows plus the prompt tokens the target leaves room for.",
        )
        self.predicted_step_time = gauge(
            "predicted_step_time_seconds",
            "The step-cost model's prediction for the latest engine step (--target-step-ms).",
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests that finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first token.", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between two outputs of a request.",
            _LATENCY_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", _REQUEST_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Time from arrival to first being scheduled.",
            _REQUEST_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens computed by one engine step.", _TOKEN_BUCKETS
        )
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Draft runs verified (one per request and step)."
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0: the first).",
            ["model_name", "position"],
            registry=self.registry,
        )
        self.kv_connector = KVConnectorMetrics(counter)
        # The engine core's counters are cumulative; these turn them into increments.
        self._last_core_counters = (0, 0, 0)
        self._last_spec_counters: tuple[int, ...] = (0, 0, 0)
        self._last_accepted_per_pos: list[int] = []

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats
    ) -> None:
        if scheduler_stats is not None:
            self.num_requests_running.set(scheduler_stats.num_running_reqs)
            self.num_requests_waiting.set(scheduler_stats.num_waiting_reqs)
            self.kv_cache_usage.set(scheduler_stats.kv_cache_usage)
            if scheduler_stats.token_budget is not None:
                self.token_budget.set(scheduler_stats.token_budget)
            if scheduler_stats.predicted_step_ms is not None:
                self.predicted_step_time.set(scheduler_stats.predicted_step_ms / 1e3)
            counters = (
                scheduler_stats.prefix_cache_queries,
                scheduler_stats.prefix_cache_hits,
                scheduler_stats.num_preemptions,
            )
            for metric, new, old in zip(
                (self.prefix_cache_queries, self.prefix_cache_hits, self.num_preemptions),
                counters,
                self._last_core_counters,
            ):
                if new > old:
                    metric.inc(new - old)
            self._last_core_counters = counters
            if scheduler_stats.spec_decoding_stats is not None:
                self._record_spec_decoding(scheduler_stats.spec_decoding_stats)
            if scheduler_stats.kv_connector_stats is not None:
                self.kv_connector.record(scheduler_stats.kv_connector_stats)
        if iteration_stats.num_scheduled_tokens:
            self.iteration_tokens.observe(iteration_stats.num_scheduled_tokens)
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.inter_token_latency.observe(itl)
        for finished in iteration_stats.finished_requests:
            self.request_success.labels(self.model_name, finished.finish_reason).inc()
            self.e2e_request_latency.observe(finished.e2e_latency)
            if finished.queue_time is not None:
                self.request_queue_time.observe(finished.queue_time)

    def _record_spec_decoding(self, stats: SpecDecodingStats) -> None:
        counters = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        metrics = (
            self.spec_decode_num_drafts,
            self.spec_decode_num_draft_tokens,
            self.spec_decode_num_accepted_tokens,
        )
        for metric, new, old in zip(metrics, counters, self._last_spec_counters):
            if new > old:
                metric.inc(new - old)
        self._last_spec_counters = counters
        per_pos = stats.num_accepted_tokens_per_pos
        last = self._last_accepted_per_pos + [0] * (len(per_pos) - len(self._last_accepted_per_pos))
        for position, (new, old) in enumerate(zip(per_pos, last)):
            child = self.spec_decode_num_accepted_tokens_per_pos.labels(self.model_name, str(position))
            if new > old:
                child.inc(new - old)
        self._last_accepted_per_pos = list(per_pos)

    def log(self) -> None:
        """Prometheus is scraped, not logged."""

    def render(self) -> bytes:
        return generate_latest(self.registry)
