"""The periodic stats line: throughput, queues, KV usage and prefix-cache hit rate."""

from __future__ import annotations

import logging

from tokenserve.messages.engine_core import SchedulerStats
from tokenserve.metrics.log_stats import LoggingStatLogger
from tokenserve.metrics.stats import IterationStats


def stats(running: int, queries: int, hits: int) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=running,
        num_waiting_reqs=1,
        kv_cache_usage=0.25,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        num_preemptions=0,
    )


def test_logs_while_busy_and_once_after(caplog):
    logger = LoggingStatLogger()
    with caplog.at_level(logging.INFO, logger="tokenserve.stats"):
        logger.record(
            stats(2, 100, 40), IterationStats(num_prompt_tokens=100, num_generation_tokens=8)
        )
        logger.log()
        [line] = caplog.messages
        assert "Running: 2 reqs, Waiting: 1 reqs" in line
        assert "KV cache usage: 25.0%" in line
        assert "Prefix cache hit rate: 40.0%" in line
        assert "Avg prompt throughput" in line and "Avg generation throughput" in line

        # The hit rate covers the interval since the last line: 10 of 100 new queries.
        idle = SchedulerStats(0, 0, 0.0, 200, 50, 0)
        logger.record(idle, IterationStats())
        logger.log()
        assert "Prefix cache hit rate: 10.0%" in caplog.messages[-1]
        # Idle twice in a row: nothing more to say.
        logger.log()
        assert len(caplog.messages) == 2


def test_data_parallel_engines_log_as_one(caplog):
    """Each engine's cumulative counters stay apart; the line sums the engines."""
    logger = LoggingStatLogger()
    with caplog.at_level(logging.INFO, logger="tokenserve.stats"):
        logger.record(stats(2, 100, 40), IterationStats(num_generation_tokens=4, engine_index=0))
        logger.record(stats(1, 100, 0), IterationStats(num_generation_tokens=4, engine_index=1))
        logger.log()
        assert "Running: 3 reqs, Waiting: 2 reqs" in caplog.messages[-1]
        assert "Prefix cache hit rate: 20.0%" in caplog.messages[-1]
        # Engine 1 reports again: 100 new queries, 50 hits, over both engines.
        logger.record(stats(1, 200, 50), IterationStats(num_generation_tokens=1, engine_index=1))
        logger.log()
        assert "Prefix cache hit rate: 50.0%" in caplog.messages[-1]
