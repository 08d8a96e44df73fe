"""One log line every few seconds while the engine is busy: throughput, queues, KV, cache hits,
and with speculative decoding its acceptance rate since the previous line."""

from __future__ import annotations

import logging
import time

from tokenserve.messages.engine_core import SchedulerStats, SpecDecodingStats
from tokenserve.metrics.stats import IterationStats

logger = logging.getLogger("tokenserve.stats")

LOG_INTERVAL_S = 5.0


class LoggingStatLogger:
    def __init__(self) -> None:
        self.last_log_time = time.monotonic()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # The latest scheduler stats of each engine (several under data parallelism).
        self.engine_stats: dict[int, SchedulerStats] = {}
        self._last_logged_prefix = (0, 0)  # (queries, hits) at the previous line
        self._last_logged_spec = (0, 0, 0)  # (drafts, draft tokens, accepted) at the previous line
        self._was_busy = False

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats
    ) -> None:
        if scheduler_stats is not None:
            self.engine_stats[iteration_stats.engine_index] = scheduler_stats
        self.num_prompt_tokens += iteration_stats.num_prompt_tokens
        self.num_generation_tokens += iteration_stats.num_generation_tokens

    def log(self) -> None:
        """Log one line if anything ran since the last one (and one more once it went idle)."""
        now = time.monotonic()
        elapsed = max(now - self.last_log_time, 1e-9)
        stats = combine_engine_stats(list(self.engine_stats.values()))
        busy = bool(
            self.num_prompt_tokens
            or self.num_generation_tokens
            or (stats is not None and (stats.num_running_reqs or stats.num_waiting_reqs))
        )
        if busy or self._was_busy:
            queries, hits = (
                (stats.prefix_cache_queries, stats.prefix_cache_hits) if stats else (0, 0)
            )
            new_queries = queries - self._last_logged_prefix[0]
            new_hits = hits - self._last_logged_prefix[1]
            self._last_logged_prefix = (queries, hits)
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%",
                self.num_prompt_tokens / elapsed,
                self.num_generation_tokens / elapsed,
                stats.num_running_reqs if stats else 0,
                stats.num_waiting_reqs if stats else 0,
                100.0 * stats.kv_cache_usage if stats else 0.0,
                100.0 * new_hits / new_queries if new_queries > 0 else 0.0,
            )
            if stats is not None and stats.spec_decoding_stats is not None:
                self._log_spec_decoding(stats.spec_decoding_stats)
        self._was_busy = busy
        self.last_log_time = now
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def _log_spec_decoding(self, spec: SpecDecodingStats) -> None:
        """vLLM's SpecDecoding line: acceptance rate and mean accepted length since the last."""
        drafts, draft_tokens, accepted = (
            spec.num_drafts - self._last_logged_spec[0],
            spec.num_draft_tokens - self._last_logged_spec[1],
            spec.num_accepted_tokens - self._last_logged_spec[2],
        )
        self._last_logged_spec = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
        if drafts == 0:
            return
        logger.info(
            "SpecDecoding metrics: Draft acceptance rate: %.1f%%, Mean acceptance length: %.2f, "
            "Accepted: %d tokens, Drafted: %d tokens",
            100.0 * accepted / draft_tokens if draft_tokens else 0.0,
            1.0 + accepted / drafts,
            accepted,
            draft_tokens,
        )


def combine_engine_stats(engine_stats: list[SchedulerStats]) -> SchedulerStats | None:
    """The engines' stats as one: queues and counters summed, KV usage averaged."""
    if len(engine_stats) <= 1:
        return engine_stats[0] if engine_stats else None
    specs = [stats.spec_decoding_stats for stats in engine_stats if stats.spec_decoding_stats]
    return SchedulerStats(
        num_running_reqs=sum(stats.num_running_reqs for stats in engine_stats),
        num_waiting_reqs=sum(stats.num_waiting_reqs for stats in engine_stats),
        kv_cache_usage=sum(stats.kv_cache_usage for stats in engine_stats) / len(engine_stats),
        prefix_cache_queries=sum(stats.prefix_cache_queries for stats in engine_stats),
        prefix_cache_hits=sum(stats.prefix_cache_hits for stats in engine_stats),
        num_preemptions=sum(stats.num_preemptions for stats in engine_stats),
        spec_decoding_stats=_sum_spec_decoding(specs) if specs else None,
    )


def _sum_spec_decoding(specs: list[SpecDecodingStats]) -> SpecDecodingStats:
    total = SpecDecodingStats(specs[0].num_spec_tokens)
    for spec in specs:
        total.num_drafts += spec.num_drafts
        total.num_draft_tokens += spec.num_draft_tokens
        total.num_accepted_tokens += spec.num_accepted_tokens
    return total
