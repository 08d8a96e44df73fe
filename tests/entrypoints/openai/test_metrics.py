"""/metrics: vLLM's metric names under `tokenserve:`, and blocks freed when a client leaves.

A client leaves a long request while the engine core is paused, and the test waits until
the server has let go of it: the request cannot run to its end first, on any host.
"""

from __future__ import annotations

import itertools
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.openai.remote_server import (
    TINY_MODEL_NAME,
    RemoteServer,
    data_events,
    metric_value,
    open_stream_once_admitted,
)

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
# As long as max_model_len (2048) allows: far more steps than the test takes to act.
LONG_GENERATION = 2000
PROBE = {
    "prompt": "Hello",
    "max_tokens": 4,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}


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


def _generation_state(server) -> tuple[float, float, float]:
    """Tokens generated for requests the API process tracks, requests finished, and tokens
    the engine core computed (whoever they were for)."""
    text = read_metrics(server)
    return (
        metric_value(text, "tokenserve:generation_tokens_total"),
        metric_value(text, "tokenserve:request_success_total"),
        metric_value(text, "tokenserve:iteration_tokens_total_sum"),
    )


@pytest.fixture(scope="module")
def one_sequence_server(tiny_model_dirs: dict[str, str]) -> Iterator[RemoteServer]:
    """Room for one sequence (--max-num-seqs 1, --max-waiting-requests 0): a request is
    refused with 503 until the API process has let go of the one before."""
    server = RemoteServer(
        tiny_model_dirs["llama"],
        "--kv-cache-memory",
        "64MiB",
        "--block-size",
        "8",
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "0",
    )
    yield server
    server.stop()


def leave_and_wait_until_let_go(server: RemoteServer, http: httpx.Client, leave) -> None:
    """Pause the engine, call `leave` (the client goes), and wait until the server admits a
    probe request, i.e. has let go of the request left: paused, that request cannot run to
    its end first, however slowly the server notices. Then the probe runs to its end."""
    with server.engine_paused():
        leave()
        probe = open_stream_once_admitted(http, PROBE)
    try:
        events = list(data_events(probe))
    finally:
        probe.close()
    assert events[-1]["usage"]["completion_tokens"] == PROBE["max_tokens"]


def assert_aborted_and_freed(server: RemoteServer, before: tuple[float, float, float]) -> None:
    """Since `before`: all blocks free, the probe finished, and the long request aborted in
    the API process (not finished) and in the engine core (not computed to its end)."""
    text = wait_until_idle_and_freed(server)
    assert metric_value(text, "tokenserve:kv_cache_usage_perc") == 0
    assert metric_value(text, "tokenserve:num_requests_running") == 0
    tokens, successes, computed = (a - b for a, b in zip(_generation_state(server), before))
    assert successes == 1  # the probe, not the request that was left
    assert 0 < tokens - PROBE["max_tokens"] < LONG_GENERATION
    assert computed < LONG_GENERATION


def test_client_disconnecting_mid_stream_frees_its_blocks(one_sequence_server):
    server = one_sequence_server
    before = _generation_state(server)
    body = {
        "prompt": "Once upon a time",
        "max_tokens": LONG_GENERATION,
        "stream": True,
        "ignore_eos": True,
    }
    with server.http() as http:
        response = http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
        try:
            assert response.status_code == 200
            # Three events in: it is generating and holds blocks, far from its end.
            assert len(list(itertools.islice(data_events(response), 3))) == 3
            leave_and_wait_until_let_go(server, http, response.close)
        finally:
            response.close()
    assert_aborted_and_freed(server, before)


def test_client_disconnecting_before_a_non_streaming_answer_frees_its_blocks(
    one_sequence_server,
):
    server = one_sequence_server
    before = _generation_state(server)
    body = json.dumps(
        {"prompt": "Once upon a time", "max_tokens": LONG_GENERATION, "ignore_eos": True}
    ).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with (
        server.http() as http,
        socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection,
    ):
        connection.sendall(request)
        # Tokens counted: it is generating and holds blocks; no answer comes before its end.
        deadline = time.monotonic() + 60
        while _generation_state(server)[0] == before[0]:
            assert time.monotonic() < deadline, "the request never started generating"
            time.sleep(0.05)
        leave_and_wait_until_let_go(server, http, connection.close)
    assert_aborted_and_freed(server, before)
