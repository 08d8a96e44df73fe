"""Prometheus gauges from the engine core's scheduler stats."""

from __future__ import annotations

from tokenserve.messages.engine_core import SchedulerStats
from tokenserve.metrics.prometheus import PrometheusStatLogger
from tokenserve.metrics.stats import IterationStats


def test_token_budget_and_predicted_step_time_gauges():
    logger = PrometheusStatLogger("m")
    stats = SchedulerStats(1, 0, 0.5, 0, 0, 0, token_budget=40, predicted_step_ms=12.5)
    logger.record(stats, IterationStats())
    text = logger.render().decode()
    assert 'tokenserve:token_budget{engine="0",model_name="m"} 40.0' in text
    assert 'tokenserve:predicted_step_time_seconds{engine="0",model_name="m"} 0.0125' in text
    # Without a target there is no prediction: the gauge keeps its last value.
    logger.record(SchedulerStats(0, 0, 0.0, 0, 0, 0, token_budget=2048), IterationStats())
    text = logger.render().decode()
    assert 'tokenserve:token_budget{engine="0",model_name="m"} 2048.0' in text
    assert 'tokenserve:predicted_step_time_seconds{engine="0",model_name="m"} 0.0125' in text


def test_each_engine_has_its_own_samples_and_counters():
    """Data parallelism: each engine's gauges and cumulative counters stay apart."""
    logger = PrometheusStatLogger("m", num_engines=2)
    # Interleaved messages: each engine's counters are cumulative on their own.
    logger.record(SchedulerStats(3, 1, 0.5, 100, 40, 0), IterationStats(engine_index=0))
    logger.record(SchedulerStats(1, 0, 0.25, 10, 2, 0), IterationStats(engine_index=1))
    logger.record(SchedulerStats(2, 0, 0.5, 120, 50, 0), IterationStats(engine_index=0))
    text = logger.render().decode()
    assert 'tokenserve:num_requests_running{engine="0",model_name="m"} 2.0' in text
    assert 'tokenserve:num_requests_running{engine="1",model_name="m"} 1.0' in text
    assert 'tokenserve:prefix_cache_queries_total{engine="0",model_name="m"} 120.0' in text
    assert 'tokenserve:prefix_cache_hits_total{engine="0",model_name="m"} 50.0' in text
    assert 'tokenserve:prefix_cache_hits_total{engine="1",model_name="m"} 2.0' in text
    assert 'tokenserve:request_success_total{engine="1",finished_reason="length",model_name="m"} 0.0' in text
