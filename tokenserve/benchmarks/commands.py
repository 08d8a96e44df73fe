"""The `tokenserve bench` command group: `throughput` (offline) and `serve` (HTTP client)."""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(subcommands: Any) -> None:
    """Add `bench throughput` and `bench serve` to the `tokenserve` subcommands."""
    # Imported here: cli.py imports this module while it builds its parser.
    from tokenserve.benchmarks import serve, throughput
    from tokenserve.entrypoints.cli import add_engine_arguments

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
    offline.set_defaults(handler=_run_throughput)

    online = kinds.add_parser(
        "serve",
        help="Latency and throughput of an OpenAI-compatible server (streamed completions).",
        description="Streams /v1/completions requests to a running OpenAI-compatible server "
                    "(tokenserve, vLLM, llama.cpp's llama-server) and reports request and token "
                    "throughput, TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99).",
    )
    serve.add_arguments(online)
    online.set_defaults(handler=_run_serve_benchmark)


def _run_throughput(args: argparse.Namespace) -> int:
    from tokenserve.benchmarks import throughput
    from tokenserve.entrypoints.cli import engine_args_from

    throughput.run(args, vars(engine_args_from(args)))
    return 0


def _run_serve_benchmark(args: argparse.Namespace) -> int:
    from tokenserve.benchmarks import serve

    report = serve.run(args)
    return 0 if report["summary"]["failed"] == 0 else 1
