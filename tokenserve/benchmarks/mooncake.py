"""Mooncake-format traces: read, write, and turn into benchmark requests.

A trace is JSONL, one request a line: `timestamp` (ms), `input_length`, `output_length`,
`hash_ids` (one id per 512-token block; equal ids = an equal prefix). Prompt tokens are
derived from the ids deterministically, each block's tokens from its id alone, so equal
ids give equal prefixes, here, in `tokenserve simulate` and on any server. Tokens past
the blocks the ids cover (a trace may list fewer) are unique to the request.

`python -m tokenserve.benchmarks.make_trace` writes one of `bench serve`'s datasets as a trace.
"""

from __future__ import annotations

import json

import numpy as np

from tokenserve.benchmarks.datasets import TOKEN_ID_MARGIN, BenchRequest
from tokenserve.metrics.request_trace import TRACE_BLOCK_SIZE, BlockIdNumbering, TraceEntry

# Seeds the tokens of a block from its id (and the tokens no id covers from the line number).
_BLOCK_SEED = 0x6D6F6F6E
_UNIQUE_SEED = 0x74726163


def read_trace(path: str) -> list[TraceEntry]:
    """The trace's requests in file order; `ValueError` naming the line on bad input."""
    entries = []
    try:
        with open(path) as file:
            lines = file.readlines()
    except OSError as error:
        raise ValueError(f"Cannot read the trace {path!r}: {error}") from error
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entries.append(_entry(json.loads(line)))
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"{path}, line {number}: not a Mooncake trace line ({error}).") from error
    if not entries:
        raise ValueError(f"The trace {path!r} has no requests.")
    return entries


def _entry(record: dict) -> TraceEntry:
    entry = TraceEntry(
        timestamp=int(record["timestamp"]),
        input_length=int(record["input_length"]),
        output_length=int(record["output_length"]),
        hash_ids=[int(h) for h in record.get("hash_ids", [])],
    )
    if entry.timestamp < 0 or entry.input_length < 1 or entry.output_length < 1:
        raise ValueError("timestamp must be >= 0, input_length and output_length >= 1")
    return entry


def write_trace(entries: list[TraceEntry], path: str) -> None:
    with open(path, "w") as file:
        file.writelines(entry.to_json() + "\n" for entry in entries)


def trace_from_requests(requests: list[BenchRequest]) -> list[TraceEntry]:
    """Benchmark requests as a trace: block ids from their tokens, in send-time order."""
    numbering = BlockIdNumbering()
    entries = [
        TraceEntry(round(r.send_time * 1000), len(r.prompt_token_ids), r.output_len,
                   numbering.hash_ids(r.prompt_token_ids))
        for r in requests
    ]
    return sorted(entries, key=lambda entry: entry.timestamp)


def prompt_token_ids(entry: TraceEntry, vocab_size: int, index: int) -> list[int]:
    """The prompt of the trace's `index`-th request: each block's tokens from its hash id."""
    if vocab_size <= 2 * TOKEN_ID_MARGIN:
        raise ValueError(f"vocab_size must exceed {2 * TOKEN_ID_MARGIN}, got {vocab_size}.")
    low, high = TOKEN_ID_MARGIN, vocab_size - TOKEN_ID_MARGIN
    tokens: list[int] = []
    for hash_id in entry.hash_ids:
        if len(tokens) >= entry.input_length:
            break
        rng = np.random.default_rng([_BLOCK_SEED, hash_id])
        tokens += rng.integers(low, high, size=TRACE_BLOCK_SIZE).tolist()
    if len(tokens) < entry.input_length:
        rng = np.random.default_rng([_UNIQUE_SEED, index])
        tokens += rng.integers(low, high, size=entry.input_length - len(tokens)).tolist()
    return tokens[:entry.input_length]


def trace_requests(entries: list[TraceEntry], vocab_size: int) -> list[BenchRequest]:
    """A trace as `bench serve` sends it: send times from the timestamps (first at 0)."""
    start = min(entry.timestamp for entry in entries)
    return [
        BenchRequest(prompt_token_ids(entry, vocab_size, index), entry.output_length,
                     (entry.timestamp - start) / 1000.0)
        for index, entry in enumerate(entries)
    ]
