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
    assert 'tokenserve:token_budget{model_name="m"} 40.0' in text
    assert 'tokenserve:predicted_step_time_seconds{model_name="m"} 0.0125' in text
    # Without a target there is no prediction: the gauge keeps its last value.
    logger.record(SchedulerStats(0, 0, 0.0, 0, 0, 0, token_budget=2048), IterationStats())
    text = logger.render().decode()
    assert 'tokenserve:token_budget{model_name="m"} 2048.0' in text
    assert 'tokenserve:predicted_step_time_seconds{model_name="m"} 0.0125' in text
