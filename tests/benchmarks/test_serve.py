"""`tokenserve bench serve` against a real tiny-model `tokenserve serve` process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entrypoints.openai.remote_server import API_KEY, TINY_MODEL_NAME, RemoteServer, free_port
from tokenserve.entrypoints.cli import main

NUM_PROMPTS = 6
INPUT_LEN = 16
OUTPUT_LEN = 8
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


@pytest.fixture(scope="module")
def bench_server(tiny_model_dirs: dict[str, str]) -> Iterator[RemoteServer]:
    server = RemoteServer(
        tiny_model_dirs["llama"],
        "--served-model-name", TINY_MODEL_NAME,
        "--kv-cache-memory", "64MiB",
        "--max-model-len", "512",
        "--block-size", "8",
        api_key=API_KEY,
    )
    yield server
    server.stop()


def bench_serve(
    server: RemoteServer, tokenizer_dir: str, tmp_path: Path, *extra: str, expect_rc: int = 0
) -> dict:
    output = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", server.url, "--api-key", API_KEY,
            "--tokenizer", tokenizer_dir, "--num-prompts", str(NUM_PROMPTS),
            "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--ignore-eos",
            "--output-json", str(output), *extra]
    assert main(argv) == expect_rc, server.log_text()[-3000:]
    return json.loads(output.read_text())


def assert_latencies_reported(figures: dict, requests: list[dict]) -> None:
    """Every latency of `requests` summed up in `figures`. The ITLs are the gaps between a
    stream's chunks, and the server merges a request's pending tokens into one chunk while
    its client reads slowly (engine/async_llm.py), so a short stream on a loaded host can
    arrive whole: the ITL figures are then absent (None), and otherwise summarize the
    requests' own gaps."""
    for name in LATENCIES:
        assert set(figures[name]) == {"mean", "p50", "p90", "p99"}, name
    gaps = [gap for request in requests for gap in request["itl_ms"]]
    for name in LATENCIES:
        if name == "itl_ms" and not gaps:
            assert all(value is None for value in figures[name].values()), name
            continue
        assert all(value is not None and value >= 0 for value in figures[name].values()), name
    if gaps:
        assert figures["itl_ms"]["mean"] == pytest.approx(sum(gaps) / len(gaps))
        assert figures["itl_ms"]["p99"] <= max(gaps) + 1e-9


def test_rate_inf_counts_every_token_and_plots(bench_server, tiny_tokenizer_dir, tmp_path):
    plot = tmp_path / "latency.png"
    report = bench_serve(bench_server, tiny_tokenizer_dir, tmp_path, "--plot", str(plot))

    assert report["model"] == TINY_MODEL_NAME  # asked GET /v1/models
    assert report["prompt_format"] == "token-ids"
    summary = report["summary"]
    assert summary["completed"] == NUM_PROMPTS and summary["failed"] == 0
    assert summary["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert summary["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    for key in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert summary[key] > 0, key
    assert_latencies_reported(summary, report["requests"])
    assert "groups" not in summary
    assert summary["num_preemptions"] == 0
    for request in report["requests"]:
        assert request["output_tokens"] == OUTPUT_LEN
        assert len(request["itl_ms"]) <= OUTPUT_LEN - 1
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_poisson_rate_and_text_prompts(bench_server, tiny_tokenizer_dir, tmp_path):
    report = bench_serve(bench_server, tiny_tokenizer_dir, tmp_path, "--request-rate", "20",
                         "--seed", "3", "--prompt-format", "text", "--max-concurrency", "2")

    assert report["prompt_format"] == "text"
    assert report["settings"]["request_rate"] == 20.0
    summary = report["summary"]
    assert summary["completed"] == NUM_PROMPTS and summary["failed"] == 0
    assert summary["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert_latencies_reported(summary, report["requests"])
    assert max(r["send_time_s"] for r in report["requests"]) > 0


def test_shared_prefix_reports_cache_hits(bench_server, tiny_tokenizer_dir, tmp_path):
    report = bench_serve(bench_server, tiny_tokenizer_dir, tmp_path, "--dataset", "shared-prefix",
                         "--prefix-len", "32", "--dataset-seed", "7")

    summary = report["summary"]
    assert summary["completed"] == NUM_PROMPTS
    assert summary["total_input_tokens"] == NUM_PROMPTS * (32 + INPUT_LEN)
    # Every request after the first finds the prefix's 4 full blocks (block size 8).
    assert summary["cached_prompt_tokens"] >= (NUM_PROMPTS - 1) * 32
    assert summary["prefix_cache_hit_rate"] is not None


def test_mixed_dataset_breaks_down_short_and_long(bench_server, tiny_tokenizer_dir, tmp_path):
    report = bench_serve(bench_server, tiny_tokenizer_dir, tmp_path, "--dataset", "mixed",
                         "--mixed-long-requests", "2", "--mixed-long-input-len", "128",
                         "--mixed-long-output-len", "4", "--request-rate", "10")

    summary = report["summary"]
    assert summary["completed"] == NUM_PROMPTS
    assert summary["total_input_tokens"] == 2 * 128 + 4 * INPUT_LEN
    assert summary["total_output_tokens"] == 2 * 4 + 4 * OUTPUT_LEN
    groups = summary["groups"]
    assert list(groups) == ["short", "long"]
    assert groups["long"]["completed"] == 2 and groups["long"]["output_tokens"] == 2 * 4
    assert groups["short"]["completed"] == 4 and groups["short"]["output_tokens"] == 4 * OUTPUT_LEN
    for name, figures in groups.items():
        assert_latencies_reported(figures, [r for r in report["requests"] if r["group"] == name])
    long_sends = [r["send_time_s"] for r in report["requests"] if r["group"] == "long"]
    assert len(long_sends) == 2


def test_failed_requests_are_counted_not_raised(bench_server, tiny_tokenizer_dir, tmp_path):
    # A forced prompt format skips the probe request, so every request goes out and fails.
    report = bench_serve(bench_server, tiny_tokenizer_dir, tmp_path, "--model", "no-such-model",
                         "--prompt-format", "token-ids", expect_rc=1)

    summary = report["summary"]
    assert summary["completed"] == 0 and summary["failed"] == NUM_PROMPTS
    assert all("HTTP 404" in r["error"] for r in report["requests"])


def test_unknown_model_fails_fast(bench_server, tiny_tokenizer_dir, tmp_path, capsys):
    argv = ["bench", "serve", "--base-url", bench_server.url, "--api-key", API_KEY,
            "--tokenizer", tiny_tokenizer_dir, "--model", "no-such-model",
            "--output-json", str(tmp_path / "unused.json")]

    assert main(argv) == 2
    assert "answered 404" in capsys.readouterr().err
    assert not (tmp_path / "unused.json").exists()


def test_unreachable_server_is_a_clear_error(tiny_tokenizer_dir, capsys):
    argv = ["bench", "serve", "--port", str(free_port()), "--tokenizer", tiny_tokenizer_dir]

    assert main(argv) == 2
    assert "Cannot reach the server" in capsys.readouterr().err


def test_sse_lines_end_only_at_cr_and_lf():
    """The client splits a stream where SSE does (CR LF, LF, CR), not at the Unicode line
    breaks str.splitlines knows, which a server may leave raw in an event's JSON."""
    import asyncio

    import httpx

    from tokenserve.benchmarks.openai_client import sse_lines

    event = 'data: {"text": "a\u2028b\x85c"}'
    chunks = [event[:12], event[12:] + "\r", "\n\ndata: [DONE]\r", "\r\n"]

    async def body():
        for chunk in chunks:
            yield chunk.encode()

    async def read() -> list[str]:
        response = httpx.Response(200, content=body())
        return [line async for line in sse_lines(response)]

    lines = [line for line in asyncio.run(read()) if line]
    assert lines == [event, "data: [DONE]"]
