"""/metrics: vLLM's metric names under `tokenserve:`, and blocks freed when a client leaves."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.entrypoints.openai.remote_server import TINY_MODEL_NAME, metric_value

METRIC_NAMES = [
    "tokenserve:num_requests_running",
    "tokenserve:num_requests_waiting",
    "tokenserve:kv_cache_usage_perc",
    "tokenserve:prefix_cache_queries_total",
    "tokenserve:prefix_cache_hits_total",
    "tokenserve:num_preemptions_total",
    "tokenserve:prompt_tokens_total",
    "tokenserve:generation_tokens_total",
    "tokenserve:request_success_total",
    "tokenserve:time_to_first_token_seconds_count",
    "tokenserve:inter_token_latency_seconds_count",
    "tokenserve:e2e_request_latency_seconds_count",
    "tokenserve:request_queue_time_seconds_count",
    "tokenserve:iteration_tokens_total_count",
]
LONG_GENERATION = 1000  # far more tokens than the test waits for (max_model_len 1024)


def read_metrics(server) -> str:
    response = httpx.get(f"{server.url}/metrics", timeout=30)
    assert response.status_code == 200
    return response.text


def wait_until_idle_and_freed(server, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = read_metrics(server)
        idle = (
            metric_value(text, "tokenserve:num_requests_running") == 0
            and metric_value(text, "tokenserve:num_requests_waiting") == 0
            and metric_value(text, "tokenserve:kv_cache_usage_perc") == 0
        )
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def test_metrics_follow_requests(tiny_server, tiny_client):
    before = read_metrics(tiny_server)
    prompt = "Metrics prompt: the quick brown fox jumps over the lazy dog. " * 3
    for _ in range(2):
        tiny_client.completions.create(
            model=TINY_MODEL_NAME,
            prompt=prompt,
            max_tokens=5,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
    after = wait_until_idle_and_freed(tiny_server)
    for name in METRIC_NAMES:
        metric_value(after, name)  # present
    assert metric_value(after, "tokenserve:num_requests_running", model_name=TINY_MODEL_NAME) == 0

    def delta(name: str, **labels: str) -> float:
        try:
            old = metric_value(before, name, **labels)
        except KeyError:
            old = 0.0
        return metric_value(after, name, **labels) - old

    assert delta("tokenserve:generation_tokens_total") == 10
    assert delta("tokenserve:prompt_tokens_total") > 0
    assert delta("tokenserve:request_success_total", finished_reason="length") == 2
    assert delta("tokenserve:time_to_first_token_seconds_count") == 2
    assert delta("tokenserve:e2e_request_latency_seconds_count") == 2
    assert delta("tokenserve:request_queue_time_seconds_count") == 2
    assert delta("tokenserve:inter_token_latency_seconds_count") == 8
    assert delta("tokenserve:iteration_tokens_total_count") >= 10
    assert delta("tokenserve:prefix_cache_queries_total") > 0
    # The second request found the first one's prompt blocks.
    assert delta("tokenserve:prefix_cache_hits_total") > 0


def _generation_state(server) -> tuple[float, float]:
    text = read_metrics(server)
    return (
        metric_value(text, "tokenserve:generation_tokens_total"),
        metric_value(text, "tokenserve:request_success_total"),
    )


def test_client_disconnecting_mid_stream_frees_its_blocks(tiny_server):
    tokens_before, successes_before = _generation_state(tiny_server)
    body = {
        "model": TINY_MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": LONG_GENERATION,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        tiny_server.http() as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                assert "error" not in json.loads(line[len("data: ") :])
                events += 1
            if events == 3:
                break  # leaving the block closes the connection mid-stream
    text = wait_until_idle_and_freed(tiny_server)
    assert metric_value(text, "tokenserve:kv_cache_usage_perc") == 0
    assert metric_value(text, "tokenserve:num_requests_running") == 0
    tokens_after, successes_after = _generation_state(tiny_server)
    # Aborted, not finished: no success counted and far fewer tokens than asked for.
    assert successes_after == successes_before
    assert tokens_after - tokens_before < LONG_GENERATION


def test_client_disconnecting_before_a_non_streaming_answer_frees_its_blocks(tiny_server):
    tokens_before, successes_before = _generation_state(tiny_server)
    body = {
        "model": TINY_MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": LONG_GENERATION,
        "ignore_eos": True,
    }
    with tiny_server.http(timeout=0.3) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body)
    text = wait_until_idle_and_freed(tiny_server)
    assert metric_value(text, "tokenserve:kv_cache_usage_perc") == 0
    tokens_after, successes_after = _generation_state(tiny_server)
    assert successes_after == successes_before
    assert tokens_after - tokens_before < LONG_GENERATION
