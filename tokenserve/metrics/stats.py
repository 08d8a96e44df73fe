"""Per-request timing, measured in the API process, turned into per-iteration stats.

The engine core reports what only it knows (scheduler gauges and counters, tokens per
step, when a request was first scheduled); `RequestStatsTracker` adds what the API
process sees: when each request arrived, got its first token and every later one, and
how it finished. Each message from the engine core becomes one `IterationStats`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from tokenserve.messages.engine_core import EngineCoreOutputs, SchedulerStats


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    queue_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What happened between two messages of the engine core."""

    num_scheduled_tokens: int = 0
    num_prompt_tokens: int = 0  # prompts of requests whose first token arrived
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # The data-parallel engine whose message this was (0 with one engine).
    engine_index: int = 0


@dataclass
class _RequestTimes:
    arrival_time: float
    num_prompt_tokens: int
    first_scheduled_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


class RequestStatsTracker:
    """Timing state of every unfinished request, keyed by engine-core request id."""

    def __init__(self) -> None:
        self.requests: dict[str, _RequestTimes] = {}

    def add_request(self, request_id: str, arrival_time: float, num_prompt_tokens: int) -> None:
        self.requests[request_id] = _RequestTimes(arrival_time, num_prompt_tokens)

    def drop_requests(self, request_ids: list[str]) -> None:
        """Forget aborted requests (they are not counted as finished)."""
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def update(self, message: EngineCoreOutputs, stopped_request_ids: list[str]) -> IterationStats:
        """Fold one engine-core message in; `stopped_request_ids` ended on a stop string."""
        now = time.time()
        stats = IterationStats(
            num_scheduled_tokens=message.num_scheduled_tokens, engine_index=message.engine_index
        )
        for request_id, scheduled_time in message.first_scheduled_times.items():
            if (times := self.requests.get(request_id)) is not None:
                times.first_scheduled_time = scheduled_time
        for output in message.outputs:
            times = self.requests.get(output.request_id)
            if times is None:
                continue
            num_new_tokens = len(output.new_token_ids)
            if num_new_tokens:
                if times.last_token_time is None:
                    stats.num_prompt_tokens += times.num_prompt_tokens
                    stats.time_to_first_tokens.append(now - times.arrival_time)
                else:
                    stats.inter_token_latencies.append(now - times.last_token_time)
                times.last_token_time = now
                times.num_generation_tokens += num_new_tokens
                stats.num_generation_tokens += num_new_tokens
            elif output.pooling_output is not None:
                stats.num_prompt_tokens += times.num_prompt_tokens  # a pooled prompt, no tokens
            if output.finish_reason is not None:
                self._finish(output.request_id, output.finish_reason, now, stats)
        for request_id in stopped_request_ids:
            self._finish(request_id, "stop", now, stats)
        return stats

    def _finish(
        self, request_id: str, finish_reason: str, now: float, stats: IterationStats
    ) -> None:
        times = self.requests.pop(request_id, None)
        if times is None:
            return
        queue_time = None
        if times.first_scheduled_time is not None:
            queue_time = max(0.0, times.first_scheduled_time - times.arrival_time)
        stats.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency=now - times.arrival_time,
                queue_time=queue_time,
                num_prompt_tokens=times.num_prompt_tokens,
                num_generation_tokens=times.num_generation_tokens,
            )
        )


class StatLogger(Protocol):
    """Something that consumes the engine's stats: Prometheus metrics, a periodic log line."""

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats
    ) -> None: ...

    def log(self) -> None: ...
