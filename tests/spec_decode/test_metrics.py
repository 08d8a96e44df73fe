"""Speculative decoding's counters: counted by the scheduler, exported to Prometheus under
vLLM's names, and the acceptance rate in the periodic log line."""

from __future__ import annotations

import logging

from tokenserve.messages.engine_core import SchedulerStats, SpecDecodingStats
from tokenserve.metrics.log_stats import LoggingStatLogger
from tokenserve.metrics.prometheus import PrometheusStatLogger
from tokenserve.metrics.stats import IterationStats


def counted(*observations: tuple[int, int]) -> SpecDecodingStats:
    stats = SpecDecodingStats(num_spec_tokens=3)
    for num_draft_tokens, num_accepted in observations:
        stats.observe(num_draft_tokens, num_accepted)
    return stats


def test_counting_per_position():
    stats = counted((3, 2), (3, 0), (2, 2))
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert stats.num_accepted_tokens_per_pos == [2, 2, 0]
    copy = stats.copy()
    stats.observe(3, 3)
    assert copy.num_accepted_tokens_per_pos == [2, 2, 0]


def test_prometheus_counters_with_vllms_names():
    logger = PrometheusStatLogger("m")
    logger.record(SchedulerStats(1, 0, 0.1, 0, 0, 0, spec_decoding_stats=counted((3, 2))),
                  IterationStats())
    # Cumulative in the engine core, increments here.
    logger.record(
        SchedulerStats(1, 0, 0.1, 0, 0, 0, spec_decoding_stats=counted((3, 2), (3, 1))),
        IterationStats(),
    )
    text = logger.render().decode()
    assert 'tokenserve:spec_decode_num_drafts_total{engine="0",model_name="m"} 2.0' in text
    assert 'tokenserve:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 6.0' in text
    assert 'tokenserve:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 3.0' in text
    per_pos = "tokenserve:spec_decode_num_accepted_tokens_per_pos_total"
    assert f'{per_pos}{{engine="0",model_name="m",position="0"}} 2.0' in text
    assert f'{per_pos}{{engine="0",model_name="m",position="1"}} 1.0' in text
    assert f'{per_pos}{{engine="0",model_name="m",position="2"}} 0.0' in text


def test_log_line_shows_the_acceptance_rate_since_the_last_one(caplog):
    logger = LoggingStatLogger()
    with caplog.at_level(logging.INFO, logger="tokenserve.stats"):
        stats = SchedulerStats(1, 0, 0.1, 0, 0, 0, spec_decoding_stats=counted((4, 3)))
        logger.record(stats, IterationStats(num_generation_tokens=4))
        logger.log()
        assert "Draft acceptance rate: 75.0%, Mean acceptance length: 4.00" in caplog.text
        stats = SchedulerStats(1, 0, 0.1, 0, 0, 0,
                               spec_decoding_stats=counted((4, 3), (4, 1), (4, 0)))
        logger.record(stats, IterationStats(num_generation_tokens=3))
        logger.log()
        assert "Draft acceptance rate: 12.5%, Mean acceptance length: 1.50" in caplog.messages[-1]
