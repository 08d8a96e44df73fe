"""Data parallelism: a `tokenserve serve -dp 2` process driven by the openai client.

Two engine cores behind one API server: concurrent requests answered as one engine
answers them, requests sharing a prefix meeting on the engine that cached it, /metrics per
engine, each engine on its own CPU core, and one engine's death taking the server down.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.remote_server import RemoteServer, metric_value
from tokenserve.entrypoints.llm import LLM
from tokenserve.sampling_params import SamplingParams

BLOCK_SIZE = 16
MODEL_NAME = "tiny-dp"
SERVER_ARGS = ("--block-size", str(BLOCK_SIZE), "--kv-cache-memory", "64MiB",
               "--served-model-name", MODEL_NAME)


def wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@pytest.fixture(scope="module")
def dp_server(tiny_model_dirs):
    server = RemoteServer(tiny_model_dirs["llama"], "-dp", "2", *SERVER_ARGS)
    yield server
    server.stop()


def test_concurrent_requests_match_one_engine(dp_server, tiny_model_dirs):
    prompts = [[5 + index, 40, 41 + index % 3, 77, 120 + index] for index in range(16)]
    client = dp_server.client()

    def complete(token_ids: list[int]) -> str:
        response = client.completions.create(
            model=MODEL_NAME, prompt=token_ids, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert response.usage.completion_tokens == 8
        return response.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(complete, prompts))
    # One engine core (DP=1), in this process.
    llm = LLM(tiny_model_dirs["llama"], block_size=BLOCK_SIZE, kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    assert texts == [output.outputs[0].text for output in expected]
    # Both engines served some, and /metrics says which.
    metrics = dp_server.http().get("/metrics").text
    for engine in ("0", "1"):
        assert metric_value(metrics, "tokenserve:request_success_total", engine=engine) > 0
        assert metric_value(metrics, "tokenserve:num_requests_running", engine=engine) == 0


def test_requests_sharing_a_prefix_meet_on_one_engine(dp_server):
    client = dp_server.client()
    prefix = [(7 * position) % 400 + 3 for position in range(4 * BLOCK_SIZE)]
    cached = []
    for tail in ([11, 12], [13]):
        # One at a time: an idle server would send the second to the other engine.
        response = client.completions.create(
            model=MODEL_NAME, prompt=prefix + tail, max_tokens=2, temperature=0
        )
        cached.append(response.usage.prompt_tokens_details.cached_tokens)
    assert cached == [0, 4 * BLOCK_SIZE]
    # A prompt with another prefix is not sent after it: it finds nothing cached.
    other = client.completions.create(
        model=MODEL_NAME, prompt=[token + 1 for token in prefix], max_tokens=2, temperature=0
    )
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_each_engine_runs_on_its_own_cores(dp_server):
    pids = dp_server.engine_core_pids()
    assert len(pids) == 2
    cores = [os.sched_getaffinity(pid) for pid in pids]
    assert all(cores) and not cores[0] & cores[1]


def test_more_engines_than_cores_fail_at_start(tiny_model_dirs):
    num_engines = len(os.sched_getaffinity(0)) + 1
    with pytest.raises(RuntimeError, match=f"data_parallel_size {num_engines} needs at least"):
        RemoteServer(tiny_model_dirs["llama"], "-dp", str(num_engines), *SERVER_ARGS)


def test_offline_llm_refuses_data_parallelism(tiny_model_dirs):
    with pytest.raises(ValueError, match="tokenserve serve"):
        LLM(tiny_model_dirs["llama"], data_parallel_size=2)


def test_one_engine_dying_fails_requests_and_health(tiny_model_dirs):
    server = RemoteServer(tiny_model_dirs["llama"], "-dp", "2", *SERVER_ARGS)
    try:
        long_request = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2000,
                        "ignore_eos": True}
        responses: list[httpx.Response] = []

        def post() -> None:
            with httpx.Client(base_url=server.url, timeout=60) as http:
                responses.append(http.post("/v1/completions", json=long_request))

        posters = [threading.Thread(target=post) for _ in range(2)]
        for poster in posters:
            poster.start()
        with server.http(timeout=30) as http:

            def running_on_both() -> bool:
                metrics = http.get("/metrics").text
                return all(
                    metric_value(metrics, "tokenserve:num_requests_running", engine=engine) == 1
                    for engine in ("0", "1")
                )

            assert wait_for(running_on_both, 30)
            os.kill(server.engine_core_pids()[0], signal.SIGKILL)
            for poster in posters:
                poster.join(timeout=60)
            # Both requests fail, the one on the surviving engine too: the server goes down.
            assert [response.status_code for response in responses] == [500, 500]
            assert "engine" in responses[0].json()["error"]["message"].lower()
            assert wait_for(lambda: http.get("/health").status_code == 503, 20)
            assert http.post("/v1/completions", json=long_request).status_code == 500
        assert server.process.wait(timeout=60) != 0
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit after an engine died:\n{server.log_text()[-3000:]}")
    finally:
        server.stop()
