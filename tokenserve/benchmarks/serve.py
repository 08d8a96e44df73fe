"""`tokenserve bench serve`: load an OpenAI-compatible server with streamed completions (W2-W5).

The client sends every request at its send time (all at once for rate inf, else a Poisson
process), at most `--max-concurrency` in flight, and times each stream. Prompts are random
token ids; they go as `prompt: [ids]` when the server takes that, else as decoded text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import time
from typing import Any

import httpx

from tokenserve.benchmarks import datasets, mooncake
from tokenserve.benchmarks.openai_client import (
    BACKENDS,
    PROMPT_FORMATS,
    CompletionTarget,
    RequestResult,
    accepts_token_ids,
    send_streaming,
    served_model_name,
    server_counters,
)
from tokenserve.benchmarks.serve_metrics import format_summary, summarize

DATASETS = ("random", "shared-prefix", "mixed", "mooncake")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default=None,
                        help="Server root, e.g. http://127.0.0.1:8000 (default: from --host/--port).")
    server.add_argument("--host", default="127.0.0.1", help="Server host, when no --base-url.")
    server.add_argument("--port", type=int, default=8000, help="Server port, when no --base-url.")
    server.add_argument("--endpoint", default="/v1/completions",
                        help="Completions route (OpenAI /v1/completions body and SSE stream).")
    server.add_argument("--model", default=None,
                        help="Served model name (default: the first one GET /v1/models lists).")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="Bearer token (default: $OPENAI_API_KEY).")
    server.add_argument("--backend", choices=BACKENDS, default="openai",
                        help="llama.cpp also sends n_predict (llama-server's output length).")
    server.add_argument("--prompt-format", choices=("auto", *PROMPT_FORMATS), default="auto",
                        help="Send token ids or decoded text (auto: token ids if the server "
                             "accepts them).")
    server.add_argument("--tokenizer", default=None,
                        help="Tokenizer (HF directory or .gguf) that draws and counts tokens "
                             "(default: the default model's).")
    server.add_argument("--request-timeout", type=float, default=1800.0,
                        help="Seconds one request may take.")

    load = parser.add_argument_group("workload")
    load.add_argument("--dataset", choices=DATASETS, default="random",
                      help="random: --input-len random tokens; shared-prefix: --prefix-len shared "
                           "+ --input-len unique; mixed: long requests at t=0 among short ones; "
                           "mooncake: the requests of --trace at their timestamps.")
    load.add_argument("--trace", default=None,
                      help="A Mooncake-format trace (JSONL: timestamp ms, input_length, "
                           "output_length, hash_ids) for --dataset mooncake.")
    load.add_argument("--num-prompts", type=int, default=64,
                      help="Requests in all (the mixed dataset's long ones included).")
    load.add_argument("--input-len", type=int, default=256, help="Prompt tokens (unique part).")
    load.add_argument("--output-len", type=int, default=64, help="Tokens to generate.")
    load.add_argument("--prefix-len", type=int, default=1024,
                      help="Shared prefix tokens (shared-prefix dataset).")
    load.add_argument("--mixed-long-requests", type=int, default=4,
                      help="Long requests sent at t=0 (mixed dataset).")
    load.add_argument("--mixed-long-input-len", type=int, default=2048,
                      help="Prompt tokens of a long request (mixed dataset).")
    load.add_argument("--mixed-long-output-len", type=int, default=16,
                      help="Output tokens of a long request (mixed dataset).")
    load.add_argument("--ignore-eos", action="store_true",
                      help="Generate exactly --output-len tokens (sends ignore_eos).")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="Requests/s of a Poisson process (inf: all at once). In the mixed "
                           "dataset, the short requests' rate.")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="Most requests in flight (default: no limit).")
    load.add_argument("--seed", type=int, default=0, help="Seed of the Poisson send times.")
    load.add_argument("--dataset-seed", type=int, default=0, help="Seed of the random prompts.")

    out = parser.add_argument_group("output")
    out.add_argument("--output-json", default=None,
                     help="Write the figures, the settings and every request's timings here.")
    out.add_argument("--plot", default=None, metavar="PATH.png",
                     help="Histograms of TTFT and ITL (needs matplotlib: tokenserve[bench]).")


def build_requests(args: argparse.Namespace, vocab_size: int) -> list[datasets.BenchRequest]:
    _validate(args)
    if args.dataset == "mooncake":
        return mooncake.trace_requests(mooncake.read_trace(args.trace), vocab_size)
    if args.dataset == "mixed":
        return datasets.mixed_requests(
            args.mixed_long_requests,
            args.mixed_long_input_len,
            args.mixed_long_output_len,
            args.num_prompts - args.mixed_long_requests,
            args.input_len,
            args.output_len,
            args.request_rate,
            vocab_size,
            args.dataset_seed,
            args.seed,
        )
    prefix_len = args.prefix_len if args.dataset == "shared-prefix" else 0
    prompts = datasets.random_token_prompts(
        args.num_prompts, args.input_len, vocab_size, args.dataset_seed, prefix_len
    )
    send_times = datasets.poisson_send_times(args.num_prompts, args.request_rate, args.seed)
    return datasets.uniform_requests(prompts, args.output_len, send_times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.plot:
        from tokenserve.benchmarks.plot import require_matplotlib

        require_matplotlib()
    # One INFO line per HTTP request would drown the report.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    tokenizer = load_tokenizer(args.tokenizer)
    requests = build_requests(args, len(tokenizer))
    report, results = asyncio.run(_benchmark(args, requests, tokenizer))
    print(format_summary(report["summary"]))
    if args.output_json:
        with open(args.output_json, "w") as file:
            json.dump(report, file, indent=2)
    if args.plot:
        from tokenserve.benchmarks.plot import plot_latencies

        plot_latencies(results, args.plot, f"{report['model']} @ {report['base_url']}")
    return report


def load_tokenizer(path: str | None):
    """The tokenizer at `path` (a directory or .gguf file), or the default model's."""
    from tokenserve.model import gguf_loader, hf_loader, loader

    if path is None:
        return loader.load_tokenizer(loader.resolve_model(None))
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise ValueError(f"Tokenizer path {path!r} does not exist.")
    if os.path.isfile(path) and path.endswith(".gguf"):
        return gguf_loader.load_gguf_tokenizer(path)
    return hf_loader.load_hf_tokenizer(path)


async def _benchmark(
    args: argparse.Namespace, requests: list[datasets.BenchRequest], tokenizer
) -> tuple[dict[str, Any], list[RequestResult]]:
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=args.max_concurrency or len(requests) or 1,
                          max_keepalive_connections=args.max_concurrency or len(requests) or 1)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        try:
            model = args.model or await served_model_name(client, base_url, headers)
            target = CompletionTarget(base_url, args.endpoint, model, args.backend,
                                      args.ignore_eos, headers)
            prompt_format = args.prompt_format
            if prompt_format == "auto":
                prompt_format = "token-ids" if await accepts_token_ids(client, target) else "text"
        except httpx.HTTPError as error:
            raise ValueError(f"Cannot reach the server at {base_url}: {error}") from error
        prompts = [_wire_prompt(r.prompt_token_ids, prompt_format, tokenizer) for r in requests]
        counters_before = await server_counters(client, base_url, headers)
        results, duration = await _send_all(client, target, requests, prompts, args.max_concurrency)
        # The server publishes its last step's stats just after the last stream ends.
        await asyncio.sleep(0.5)
        counters_after = await server_counters(client, base_url, headers)

    summary = summarize(results, duration)
    summary.update(_counter_deltas(counters_before, counters_after))
    report = {
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model": model,
        "backend": args.backend,
        "prompt_format": prompt_format,
        "settings": {key: _json_safe(value) for key, value in vars(args).items()
                     if key not in ("handler", "api_key")},
        "summary": summary,
        "requests": [_request_record(r) for r in results],
    }
    return report, results


async def _send_all(
    client: httpx.AsyncClient,
    target: CompletionTarget,
    requests: list[datasets.BenchRequest],
    prompts: list[tuple[str | list[int], int]],
    max_concurrency: int | None,
) -> tuple[list[RequestResult], float]:
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    started = time.perf_counter()

    async def one(request: datasets.BenchRequest, prompt: str | list[int], length: int):
        await asyncio.sleep(max(0.0, started + request.send_time - time.perf_counter()))
        send_time = time.perf_counter() - started
        if limit is None:
            result = await send_streaming(client, target, request, prompt, length)
        else:
            async with limit:
                result = await send_streaming(client, target, request, prompt, length)
        result.send_time = send_time
        return result

    results = await asyncio.gather(
        *(one(request, prompt, length) for request, (prompt, length) in zip(requests, prompts))
    )
    return list(results), time.perf_counter() - started


def _wire_prompt(token_ids: list[int], prompt_format: str, tokenizer) -> tuple[str | list[int], int]:
    """The prompt as sent, and its length in tokens as the tokenizer counts it."""
    if prompt_format == "token-ids":
        return token_ids, len(token_ids)
    text = tokenizer.decode(token_ids)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def _counter_deltas(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float | None]:
    if before is None or after is None:
        return {"prefix_cache_hit_rate": None, "num_preemptions": None}
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    queries = delta.get("prefix_cache_queries")
    hit_rate = delta.get("prefix_cache_hits", 0.0) / queries if queries else None
    return {"prefix_cache_hit_rate": hit_rate, "num_preemptions": delta.get("num_preemptions")}


def _request_record(result: RequestResult) -> dict[str, Any]:
    return {
        "group": result.group,
        "success": result.success,
        "error": result.error,
        "send_time_s": result.send_time,
        "prompt_tokens": result.prompt_tokens,
        "output_tokens": result.output_tokens,
        "cached_tokens": result.cached_tokens,
        "ttft_ms": result.ttft * 1000 if result.ttft is not None else None,
        "e2el_ms": result.latency * 1000,
        "itl_ms": [gap * 1000 for gap in result.inter_token_latencies],
        "text": result.text,
    }


def _validate(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1.")
    if args.request_rate <= 0:
        raise ValueError("--request-rate must be positive (or inf).")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1.")
    if (args.dataset == "mooncake") != (getattr(args, "trace", None) is not None):
        raise ValueError("--trace goes with --dataset mooncake, and --dataset mooncake needs it.")
    if args.dataset == "shared-prefix" and args.prefix_len < 1:
        raise ValueError("--prefix-len must be at least 1 for the shared-prefix dataset.")
    if args.dataset == "mixed" and not 0 < args.mixed_long_requests < args.num_prompts:
        raise ValueError(
            "The mixed dataset needs 0 < --mixed-long-requests < --num-prompts "
            f"(got {args.mixed_long_requests} and {args.num_prompts})."
        )


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return value
