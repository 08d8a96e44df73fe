"""What /dashboard shows of the engine core: the KV block map and the queues.

Built from the scheduler's own state (its block pool, running list and waiting queue)
at a bounded rate (`SnapshotClock`), so a busy engine pays for it a few times a second,
not every step.
"""

from __future__ import annotations

import time

from tokenserve.core.request import Request, RequestStatus
from tokenserve.core.scheduler import Scheduler
from tokenserve.core.step_cost import StepShape
from tokenserve.messages.engine_core import (
    BLOCK_CACHED,
    BLOCK_FREE,
    BLOCK_SHARED,
    DashboardSnapshot,
    RequestSnapshot,
)
from tokenserve.messages.scheduler_output import SchedulerOutput

# The most snapshots per second the engine core sends.
SNAPSHOT_INTERVAL_S = 0.25


class SnapshotClock:
    """Says when the next snapshot is due (at most one per SNAPSHOT_INTERVAL_S)."""

    def __init__(self, interval_s: float = SNAPSHOT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last = -float("inf")

    def due(self, force: bool = False) -> bool:
        now = time.monotonic()
        if force or now - self._last >= self.interval_s:
            self._last = now
            return True
        return False


def dashboard_snapshot(scheduler: Scheduler) -> DashboardSnapshot:
    requests: list[Request] = [*scheduler.running, *scheduler.waiting]
    pool = scheduler.kv_cache_manager.block_pool
    owners = [BLOCK_CACHED if block.block_hash is not None else BLOCK_FREE for block in pool.blocks]
    for index, request in enumerate(requests):
        for block_id in scheduler.kv_cache_manager.get_block_ids(request.request_id):
            unowned = owners[block_id] in (BLOCK_FREE, BLOCK_CACHED)
            owners[block_id] = index if unowned else BLOCK_SHARED
    return DashboardSnapshot(
        block_owners=owners,
        requests=[_request_snapshot(r) for r in requests],
    )


def _request_snapshot(request: Request) -> RequestSnapshot:
    status = {RequestStatus.RUNNING: "running", RequestStatus.PREEMPTED: "preempted"}
    return RequestSnapshot(
        request_id=request.request_id,
        status=status.get(request.status, "waiting"),
        num_prompt_tokens=request.num_prompt_tokens,
        num_computed_tokens=request.num_computed_tokens,
        num_tokens=request.num_tokens,
        num_preemptions=request.num_preemptions,
    )


def num_decode_tokens(scheduler_output: SchedulerOutput) -> int:
    """Tokens of the step's decode rows (as the step-cost model counts them)."""
    return StepShape.of(scheduler_output).num_decode_tokens
