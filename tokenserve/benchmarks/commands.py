"""The `tokenserve bench` command group: `throughput` (offline), `serve` (HTTP client) and
`startup` (from `tokenserve serve` to the first answer)."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from tokenserve.benchmarks import serve, startup, throughput
from tokenserve.engine.cli_args import add_engine_arguments, engine_args_from


def add_bench_parser(subcommands: Any, llm_class: Callable[..., Any]) -> None:
    """Add `bench throughput` and `bench serve` to the `tokenserve` subcommands.

    `llm_class` is the offline engine `bench throughput` measures: the command line passes
    its `LLM` (benchmarks sit below the command line and import nothing of entrypoints).
    """
    bench = subcommands.add_parser("bench", help="Measure throughput and latency.")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    offline = kinds.add_parser(
        "throughput",
        help="Offline throughput of LLM.generate (W1 by default).",
        description="Offline, in-process throughput: --num-prompts random-token prompts of "
                    "--input-len tokens, all submitted at once, greedy, EOS ignored, "
                    "--output-len tokens each. Prints requests/s, output and total tokens/s.",
    )
    throughput.add_arguments(offline)
    add_engine_arguments(offline, positional_model=False)
    offline.set_defaults(handler=functools.partial(_run_throughput, llm_class=llm_class))

    online = kinds.add_parser(
        "serve",
        help="Latency and throughput of an OpenAI-compatible server (streamed completions).",
        description="Streams /v1/completions requests to a running OpenAI-compatible server "
                    "(tokenserve, vLLM, llama.cpp's llama-server) and reports request and token "
                    "throughput, TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99).",
    )
    serve.add_arguments(online)
    online.set_defaults(handler=_run_serve_benchmark)

    start = kinds.add_parser(
        "startup",
        help="Seconds from `tokenserve serve` to /health 200 and to the first chat answer; RSS.",
        description="Starts `tokenserve serve [serve args]` --num-runs times, each time waiting "
                    "for /health and one chat answer (temperature 0, max_tokens 8): the split "
                    "import / load / ready / first token, and the server's resident memory. "
                    "--cold: after emptying tokenserve's cache directory (docs/STARTUP.md).",
    )
    startup.add_arguments(start)
    start.set_defaults(handler=lambda args: 0 if startup.run(args) else 1)


def _run_throughput(args: argparse.Namespace, llm_class: Callable[..., Any]) -> int:
    throughput.run(args, vars(engine_args_from(args)), llm_class)
    return 0


def _run_serve_benchmark(args: argparse.Namespace) -> int:
    report = serve.run(args)
    return 0 if report["summary"]["failed"] == 0 else 1
