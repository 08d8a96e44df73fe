"""`python -m tokenserve.benchmarks.make_trace OUT.jsonl [bench serve workload flags]`.

Writes one of `bench serve`'s datasets (W2-W5: random, shared-prefix, mixed) as a
Mooncake trace, so that `bench serve --dataset mooncake` and `tokenserve simulate` replay
the same requests (tokens re-derived from the block ids: the sharing is kept, the ids not).
"""

from __future__ import annotations

import argparse
import sys

from tokenserve.benchmarks import mooncake, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tokenserve.benchmarks.make_trace",
        description="Write one of bench serve's datasets as a Mooncake trace.",
    )
    parser.add_argument("output", help="The trace file to write (JSONL).")
    serve.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.dataset == "mooncake":
        parser.error("--dataset mooncake is a trace already.")
    tokenizer = serve.load_tokenizer(args.tokenizer)
    entries = mooncake.trace_from_requests(serve.build_requests(args, len(tokenizer)))
    mooncake.write_trace(entries, args.output)
    print(f"{len(entries)} requests written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
