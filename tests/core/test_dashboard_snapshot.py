"""/dashboard's view of the scheduler: the block map's codes and the queues, and a step's
decode-token count."""

from __future__ import annotations

from tokenserve.core.dashboard_snapshot import dashboard_snapshot, num_decode_tokens
from tokenserve.core.request import RequestStatus
from tokenserve.messages.engine_core import BLOCK_CACHED, BLOCK_FREE, BLOCK_SHARED
from tokenserve.messages.model_runner_output import ModelRunnerOutput

from .test_scheduler import add, make_scheduler, step


def test_block_map_marks_owners_shared_cached_and_free():
    scheduler = make_scheduler(num_blocks=8, budget=64, block_size=4)
    add(scheduler, "first", 10, max_tokens=4)
    step(scheduler)
    # The same 10 tokens: its first two (full) blocks are found in the cache.
    add(scheduler, "second", 10, max_tokens=4)
    step(scheduler)
    snapshot = dashboard_snapshot(scheduler)
    assert [(r.request_id, r.status) for r in snapshot.requests] == [
        ("first", "running"), ("second", "running")]
    owners = snapshot.block_owners
    assert owners.count(BLOCK_SHARED) == 2
    assert sorted(o for o in owners if o >= 0) == [0, 1]  # each one's own tail block
    assert owners.count(BLOCK_FREE) == 8 - 4
    scheduler.finish_requests(["first", "second"], RequestStatus.FINISHED_ABORTED)
    idle = dashboard_snapshot(scheduler)
    assert idle.requests == []
    # Freed full blocks keep their hash: cached and evictable.
    assert idle.block_owners.count(BLOCK_CACHED) >= 2
    assert all(o in (BLOCK_FREE, BLOCK_CACHED) for o in idle.block_owners)


def test_waiting_requests_follow_the_running_ones():
    scheduler = make_scheduler(num_blocks=8, budget=8, block_size=4)
    add(scheduler, "a", 8, max_tokens=4)
    add(scheduler, "b", 8, max_tokens=4, first_token=100)
    step(scheduler)  # the budget admits only a
    snapshot = dashboard_snapshot(scheduler)
    assert [(r.request_id, r.status) for r in snapshot.requests] == [("a", "running"), ("b", "waiting")]
    assert snapshot.requests[0].num_computed_tokens == 8 and snapshot.requests[1].num_computed_tokens == 0


def test_decode_tokens_are_one_token_rows_of_running_requests():
    scheduler = make_scheduler(num_blocks=16, budget=64, block_size=4)
    add(scheduler, "a", 10, max_tokens=4)
    first = scheduler.schedule()
    assert num_decode_tokens(first) == 0  # a prompt
    scheduler.update_from_output(first, ModelRunnerOutput(["a"], [[1]]))
    add(scheduler, "b", 1, max_tokens=4, first_token=50)  # a one-token prompt is a prompt row
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"a": 1, "b": 1}
    assert num_decode_tokens(second) == 1
