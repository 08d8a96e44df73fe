"""`tokenserve serve --speculative-config`: the server speculates (the engine-core process
proposes and verifies), /metrics carries the spec_decode counters, and a bad value stops
the server at start with the error. Exactness is tested offline (test_correctness.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.entrypoints.openai.remote_server import TINY_MODEL_NAME, RemoteServer, metric_value

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
PROMPT = "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over"


def complete(server: RemoteServer) -> str:
    response = server.client().completions.create(
        model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0.0
    )
    return response.choices[0].text


def test_server_with_speculative_config(tiny_model_dirs):
    draft = {"method": "draft_model", "model": tiny_model_dirs["llama"],
             "num_speculative_tokens": 3}
    server = RemoteServer(tiny_model_dirs["llama"], "--served-model-name", TINY_MODEL_NAME,
                          "--kv-cache-memory", "16MiB", "--speculative-config", json.dumps(draft))
    try:
        assert complete(server)
        with server.http() as http:
            metrics = http.get("/metrics").text
        drafted = metric_value(metrics, "tokenserve:spec_decode_num_draft_tokens_total")
        accepted = metric_value(metrics, "tokenserve:spec_decode_num_accepted_tokens_total")
        # The model is its own draft: every draft is accepted.
        assert drafted > 0 and accepted == drafted
        assert metric_value(metrics, "tokenserve:spec_decode_num_drafts_total") > 0
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("value", "message"),
    [("{not json", "must be a JSON object"),
     (json.dumps({**NGRAM, "prompt_lookup_max": 2, "prompt_lookup_min": 4}),
      "must not exceed prompt_lookup_max")],
)
def test_bad_speculative_config_stops_the_server(tiny_model_dirs, value, message):
    result = subprocess.run(
        [sys.executable, "-m", "tokenserve.entrypoints.cli", "serve", tiny_model_dirs["llama"],
         "--speculative-config", value],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode != 0
    assert message in result.stderr
