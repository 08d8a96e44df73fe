"""The live state behind /dashboard, kept in the API process from the engine core's messages.

Each message brings a step's prefill and decode token counts and the scheduler's stats;
a few times a second those carry a `DashboardSnapshot` (the KV block map and the queues,
core/dashboard_snapshot.py). Per-request timelines (arrival, first scheduled, first token,
preemptions, finish) are put together here from the requests' own messages. Everything
is bounded: the latest steps, the latest finished requests.
"""

from __future__ import annotations

import collections
import time
from dataclasses import asdict, dataclass
from typing import Any

from tokenserve.messages.engine_core import DashboardSnapshot, EngineCoreOutputs, SchedulerStats

# Steps kept for the prefill / decode chart, and finished requests kept for the timelines.
MAX_STEPS = 300
MAX_FINISHED_TIMELINES = 60
# Prefix-cache hit-rate points kept (one per stats message that moved the counters).
MAX_HIT_RATE_POINTS = 300


@dataclass
class RequestTimeline:
    request_id: str
    num_prompt_tokens: int
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None


class DashboardState:
    """A `RequestObserver` (metrics/request_trace.py) that answers /dashboard/state."""

    def __init__(self) -> None:
        self.steps: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=MAX_STEPS)
        self.hit_rates: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=MAX_HIT_RATE_POINTS
        )
        self.stats: SchedulerStats | None = None
        self.snapshot: DashboardSnapshot | None = None
        self.timelines: dict[str, RequestTimeline] = {}
        self.finished: collections.deque[RequestTimeline] = collections.deque(
            maxlen=MAX_FINISHED_TIMELINES
        )
        self.total_prefill_tokens = 0
        self.total_decode_tokens = 0
        self._last_counters = (0, 0)

    # ---- RequestObserver -----------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], arrival_time: float) -> None:
        self.timelines[request_id] = RequestTimeline(request_id, len(prompt_token_ids), arrival_time)

    def drop_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            timeline = self.timelines.pop(request_id, None)
            if timeline is not None and timeline.finished is None:
                timeline.finished, timeline.finish_reason = time.time(), "abort"
                self.finished.append(timeline)

    def record(self, message: EngineCoreOutputs) -> None:
        now = message.timestamp or time.time()
        if message.num_scheduled_tokens:
            prefill = message.num_scheduled_tokens - message.num_decode_tokens
            self.steps.append((now, prefill, message.num_decode_tokens))
            self.total_prefill_tokens += prefill
            self.total_decode_tokens += message.num_decode_tokens
        for request_id, scheduled in message.first_scheduled_times.items():
            if (timeline := self.timelines.get(request_id)) is not None:
                timeline.first_scheduled = scheduled
        for output in message.outputs:
            timeline = self.timelines.get(output.request_id)
            if timeline is None:
                continue
            if output.new_token_ids and timeline.first_token is None:
                timeline.first_token = now
            timeline.num_output_tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                timeline.finished, timeline.finish_reason = now, output.finish_reason
                self.finished.append(self.timelines.pop(output.request_id))
        if message.scheduler_stats is not None:
            self._record_stats(now, message.scheduler_stats)

    def close(self) -> None:
        pass

    # ---- state -----------------------------------------------------------------------

    def _record_stats(self, now: float, stats: SchedulerStats) -> None:
        self.stats = stats
        counters = (stats.prefix_cache_queries, stats.prefix_cache_hits)
        if counters != self._last_counters:
            queries = counters[0] - self._last_counters[0]
            hits = counters[1] - self._last_counters[1]
            if queries > 0:
                self.hit_rates.append((now, hits / queries))
            self._last_counters = counters
        if stats.dashboard is not None:
            self.snapshot = stats.dashboard
            for request in stats.dashboard.requests:
                if (timeline := self.timelines.get(request.request_id)) is not None:
                    timeline.num_preemptions = max(timeline.num_preemptions, request.num_preemptions)

    def state(self) -> dict[str, Any]:
        """The JSON /dashboard/state answers."""
        stats = self.stats
        snapshot = self.snapshot
        queries = stats.prefix_cache_queries if stats else 0
        return {
            "time": time.time(),
            "num_running_reqs": stats.num_running_reqs if stats else 0,
            "num_waiting_reqs": stats.num_waiting_reqs if stats else 0,
            "kv_cache_usage": stats.kv_cache_usage if stats else 0.0,
            "prefix_cache_hit_rate": stats.prefix_cache_hits / queries if stats and queries else None,
            "num_preemptions": stats.num_preemptions if stats else 0,
            "token_budget": stats.token_budget if stats else None,
            "total_prefill_tokens": self.total_prefill_tokens,
            "total_decode_tokens": self.total_decode_tokens,
            "blocks": snapshot.block_owners if snapshot else [],
            "requests": [
                {"id": r.request_id, "status": r.status, "prompt": r.num_prompt_tokens,
                 "computed": r.num_computed_tokens, "tokens": r.num_tokens,
                 "preemptions": r.num_preemptions}
                for r in (snapshot.requests if snapshot else [])
            ],
            "steps": [list(step) for step in self.steps],
            "hit_rates": [list(point) for point in self.hit_rates],
            "timelines": [asdict(t) for t in (*self.finished, *self.timelines.values())],
        }
