"""Send times and the serving figures, on hand-made results."""

from __future__ import annotations

import itertools
import math

import pytest

from tokenserve.benchmarks.datasets import mixed_requests, poisson_send_times
from tokenserve.benchmarks.openai_client import RequestResult
from tokenserve.benchmarks.serve_metrics import summarize


def result(group: str, ttft: float, chunk_times: list[float], output_tokens: int) -> RequestResult:
    return RequestResult(group=group, success=True, ttft=ttft, latency=chunk_times[-1],
                         chunk_times=chunk_times, prompt_tokens=10, output_tokens=output_tokens)


def test_poisson_send_times_are_seeded_and_increasing():
    times = poisson_send_times(200, rate=4.0, seed=0)

    assert times == poisson_send_times(200, rate=4.0, seed=0)
    assert times != poisson_send_times(200, rate=4.0, seed=1)
    assert times[0] == 0.0 and all(a < b for a, b in itertools.pairwise(times))
    assert times[-1] / 199 == pytest.approx(0.25, rel=0.2)  # mean gap 1 / rate
    assert poisson_send_times(3, rate=math.inf, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="positive"):
        poisson_send_times(3, rate=0.0, seed=0)


def test_mixed_requests_send_long_ones_first_at_zero():
    requests = mixed_requests(2, 64, 4, 3, 8, 16, 2.0, vocab_size=500, dataset_seed=0,
                              arrival_seed=0)

    assert [r.group for r in requests] == ["long", "long", "short", "short", "short"]
    assert [len(r.prompt_token_ids) for r in requests] == [64, 64, 8, 8, 8]
    assert [r.output_len for r in requests] == [4, 4, 16, 16, 16]
    assert [r.send_time for r in requests[:3]] == [0.0, 0.0, 0.0]
    assert all(100 <= t < 400 for r in requests for t in r.prompt_token_ids)


def test_summary_figures():
    results = [
        result("short", 0.1, [0.1, 0.2, 0.3], output_tokens=3),  # TPOT 0.1, ITLs 0.1 0.1
        result("long", 0.5, [0.5, 0.9], output_tokens=2),  # TPOT 0.4, ITL 0.4
        RequestResult(group="short", error="HTTP 500"),
    ]

    summary = summarize(results, duration=2.0)

    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["total_output_tokens"] == 5 and summary["total_input_tokens"] == 20
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["output_throughput"] == pytest.approx(2.5)
    assert summary["total_token_throughput"] == pytest.approx(12.5)
    assert summary["ttft_ms"]["mean"] == pytest.approx(300.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(250.0)
    assert summary["itl_ms"]["mean"] == pytest.approx(200.0)  # pooled: 100, 100, 400
    assert summary["itl_ms"]["p50"] == pytest.approx(100.0)
    assert summary["e2el_ms"]["p50"] == pytest.approx(600.0)
    assert list(summary["groups"]) == ["short", "long"]
    assert summary["groups"]["short"]["completed"] == 1
    assert summary["groups"]["long"]["tpot_ms"]["p99"] == pytest.approx(400.0)
    assert summary["cached_prompt_tokens"] is None  # no request reported it
