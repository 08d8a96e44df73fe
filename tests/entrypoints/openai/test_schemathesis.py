"""The server fuzzed over its own OpenAPI schema (schemathesis): no 5xx, no hang, no leak.

A real `tokenserve serve` process (tiny model, max_model_len 64, an API key) publishes
/openapi.json; schemathesis reads it over HTTP and sends generated requests to that
process: schema-valid and schema-invalid bodies (its fuzzing phase). Every response must
be below 500 with OpenAI's error body for each 4xx, and come within a per-request
timeout. A schema-valid completion or chat body that got a 400 is sent a second time
with the fields that nearly always make fuzzed input a 400 (numbers out of range, unknown
model, priority under FCFS, ...) left out, so fuzzed text, stop strings, bad words, seeds
and salts reach the engine too. Hypothesis is derandomized: the same cases every run.

Bounded: at most MAX_EXAMPLES generated cases per operation (13 operations
with /v1/responses and /v1/models/{id}; ~55 s in all), each request at most REQUEST_TIMEOUT_S.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

from tests.entrypoints.openai.remote_server import API_KEY, RemoteServer, metric_value

MAX_EXAMPLES = 50
REQUEST_TIMEOUT_S = 30.0
# Fields that a fuzzed body almost never gets right; left out of the second sending.
FRAGILE_FIELDS = frozenset(
    {
        "model", "n", "best_of", "suffix", "priority", "stream_options", "max_tokens",
        "max_completion_tokens", "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs",
        "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "allowed_token_ids", "stop_token_ids",
        "chat_template", "add_generation_prompt", "continue_final_message", "echo",
    }
)  # fmt: skip


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dirs: dict[str, str]) -> Iterator[RemoteServer]:
    server = RemoteServer(
        tiny_model_dirs["llama"],
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "64",
        "--block-size",
        "8",
        "--max-n",
        "4",
        api_key=API_KEY,
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server: RemoteServer) -> Any:
    schema = schemathesis.openapi.from_url(
        f"{fuzz_server.url}/openapi.json", headers=fuzz_server.headers, timeout=30
    )
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    # The coverage phase alone would send ~1,500 boundary cases; the fuzzing phase is bounded.
    schema.config.phases.coverage.enabled = False
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


def assert_openai_error_body(response: Any) -> None:
    assert response.status_code != 422, "validation errors must be 400"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, response.text


def with_fragile_fields_left_out(body: dict[str, Any]) -> dict[str, Any]:
    plain = {key: value for key, value in body.items() if key not in FRAGILE_FIELDS}
    if "prompt" in plain:  # token ids are brought into the tiny vocabulary
        plain["prompt"] = in_tiny_vocabulary(plain["prompt"])
    return {**plain, "max_tokens": 4}


def in_tiny_vocabulary(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) % 256
    if isinstance(value, list):
        return [in_tiny_vocabulary(item) for item in value]
    return value


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_fuzzed_requests_get_no_server_error(case: Any, fuzz_server: RemoteServer) -> None:
    response = case.call_and_validate(
        headers=fuzz_server.headers, checks=[not_a_server_error], timeout=REQUEST_TIMEOUT_S
    )
    assert_openai_error_body(response)
    if (
        case.method == "POST"
        and case.path in ("/v1/completions", "/v1/chat/completions")
        and isinstance(case.body, dict)
        and response.status_code == 400
        and not case.meta.generation.mode.is_negative
    ):
        body = with_fragile_fields_left_out(case.body)
        with httpx.Client(headers=fuzz_server.headers, timeout=REQUEST_TIMEOUT_S) as http:
            again = http.post(f"{fuzz_server.url}{case.path}", json=body)
        assert again.status_code < 500, (body, again.text)
        assert_openai_error_body(again)


def test_server_is_healthy_and_idle_after_fuzzing(fuzz_server: RemoteServer) -> None:
    # Runs after the fuzzing above (file order): nothing leaked, nothing broke.
    deadline = time.monotonic() + 60
    with fuzz_server.http() as http:
        while True:
            text = http.get("/metrics").text
            usage = metric_value(text, "tokenserve:kv_cache_usage_perc")
            running = metric_value(text, "tokenserve:num_requests_running")
            if (usage, running) == (0, 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert (usage, running) == (0, 0)
        assert metric_value(text, "tokenserve:num_requests_waiting") == 0
        assert http.get("/health").status_code == 200
        response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert response.status_code == 200
