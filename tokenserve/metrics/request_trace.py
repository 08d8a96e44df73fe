"""Served traffic as a Mooncake-format trace: `tokenserve serve --request-trace FILE`.

One JSON line per finished request: `timestamp` (ms after the server started), its
`input_length` and `output_length` in tokens, and `hash_ids`, one small integer per
512-token block of the prompt (the last one may be partial). Each id stands for a chained
hash of the block and every block before it, numbered in order of first appearance, so
equal ids mean an equal prefix, as in Mooncake's public traces. No text and no token id
is written. `benchmarks/mooncake.py` reads these files back.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import IO, Protocol

from tokenserve.messages.engine_core import EngineCoreOutputs

# Mooncake's traces hash prompts in blocks of this many tokens.
TRACE_BLOCK_SIZE = 512


class RequestObserver(Protocol):
    """What AsyncLLM tells about each request: its arrival, every engine-core message, aborts."""

    def add_request(self, request_id: str, prompt_token_ids: list[int], arrival_time: float) -> None: ...

    def record(self, message: EngineCoreOutputs) -> None: ...

    def drop_requests(self, request_ids: list[str]) -> None: ...

    def close(self) -> None: ...


@dataclass
class TraceEntry:
    """One request of a Mooncake trace."""

    timestamp: int  # ms after the trace starts
    input_length: int
    output_length: int
    hash_ids: list[int]

    def to_json(self) -> str:
        return json.dumps(
            {
                "timestamp": self.timestamp,
                "input_length": self.input_length,
                "output_length": self.output_length,
                "hash_ids": self.hash_ids,
            }
        )


class BlockIdNumbering:
    """Chained block hashes → small integers, numbered in order of first appearance."""

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}

    def hash_ids(self, token_ids: list[int]) -> list[int]:
        ids = []
        parent = b""
        for start in range(0, len(token_ids), TRACE_BLOCK_SIZE):
            block = token_ids[start:start + TRACE_BLOCK_SIZE]
            digest = hashlib.blake2b(parent, digest_size=16)
            digest.update(json.dumps(block).encode())
            parent = digest.digest()
            ids.append(self._ids.setdefault(parent, len(self._ids)))
        return ids


class RequestTraceRecorder:
    """Writes one trace line per finished request (the hook AsyncLLM calls)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] = open(path, "w")  # noqa: SIM115 - open while the server runs
        self._numbering = BlockIdNumbering()
        self._started = time.time()
        # Request id → (arrival ms, prompt length, hash ids, output tokens so far).
        self._pending: dict[str, tuple[int, int, list[int], int]] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], arrival_time: float) -> None:
        arrival_ms = max(0, round((arrival_time - self._started) * 1000))
        hash_ids = self._numbering.hash_ids(list(prompt_token_ids))
        self._pending[request_id] = (arrival_ms, len(prompt_token_ids), hash_ids, 0)

    def record(self, message: EngineCoreOutputs) -> None:
        for output in message.outputs:
            pending = self._pending.get(output.request_id)
            if pending is None:
                continue
            arrival_ms, input_length, hash_ids, output_length = pending
            output_length += len(output.new_token_ids)
            if output.finish_reason is None:
                self._pending[output.request_id] = (arrival_ms, input_length, hash_ids, output_length)
                continue
            del self._pending[output.request_id]
            if output.finish_reason == "abort" or output.pooling_output is not None:
                continue  # not generate traffic to replay
            entry = TraceEntry(arrival_ms, input_length, output_length, hash_ids)
            self._file.write(entry.to_json() + "\n")
            self._file.flush()

    def drop_requests(self, request_ids: list[str]) -> None:
        """Aborted requests are not traffic to replay."""
        for request_id in request_ids:
            self._pending.pop(request_id, None)

    def close(self) -> None:
        self._file.close()
