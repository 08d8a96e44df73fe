"""The scheduler with several steps under way at once (pipeline parallelism: a step is
scheduled before the ones before it are answered)."""

from __future__ import annotations

from tokenserve.config import CacheConfig, SchedulerConfig
from tokenserve.core.request import RequestStatus
from tokenserve.core.scheduler import Scheduler
from tokenserve.messages.model_runner_output import ModelRunnerOutput

from .invariants import check_block_pool_invariants
from .test_scheduler import add


def make_scheduler(num_blocks, budget, policy="fcfs", pipeline_parallel=True):
    return Scheduler(
        SchedulerConfig(budget, 8, num_blocks * 4, True, policy, admission_lookahead_tokens=0),
        CacheConfig(4, num_blocks, True, "sha256"),
        pipeline_parallel=pipeline_parallel,
    )


def answer(scheduler, output, token=1):
    """The step's output: `token` for every request whose scheduled tokens reached its end
    (the scheduler advanced num_computed_tokens when it scheduled the step)."""
    sampled = [
        rid for rid, n in output.num_scheduled_tokens.items()
        if rid in scheduler.requests
        and output_end(scheduler, output, rid) == scheduler.requests[rid].num_tokens
    ]
    scheduler.update_from_output(output, ModelRunnerOutput(sampled, [[token] for _ in sampled]))
    check_block_pool_invariants(scheduler.kv_cache_manager)


def output_end(scheduler, output, request_id):
    """The position after the last one `output` scheduled for the request."""
    for new in output.scheduled_new_reqs:
        if new.request_id == request_id:
            return new.num_computed_tokens + output.num_scheduled_tokens[request_id]
    for cached in output.scheduled_cached_reqs:
        if cached.request_id == request_id:
            return cached.num_computed_tokens + output.num_scheduled_tokens[request_id]
    raise AssertionError(request_id)


def test_prompt_chunks_run_ahead_and_a_decode_waits_for_its_token():
    scheduler = make_scheduler(num_blocks=16, budget=8)
    add(scheduler, "long", 20)
    # The prompt's chunks need no sampled token: each step takes the next while the ones
    # before are under way.
    chunks = [scheduler.schedule() for _ in range(3)]
    assert [c.num_scheduled_tokens for c in chunks] == [{"long": 8}, {"long": 8}, {"long": 4}]
    # Every token is under way: nothing to compute until the last chunk's token is back.
    assert scheduler.schedule().is_empty
    for chunk in chunks:
        answer(scheduler, chunk, token=77)
    decode = scheduler.schedule()
    assert decode.num_scheduled_tokens == {"long": 1}
    # The stages before the last learn the sampled token with the step that computes it.
    (cached,) = decode.scheduled_cached_reqs
    assert cached.new_token_ids == [77]
    assert scheduler.schedule().is_empty  # its token is under way again
    answer(scheduler, decode)
    assert scheduler.requests["long"].num_tokens == 22


def test_without_pipeline_stages_no_tokens_travel_with_the_step():
    scheduler = make_scheduler(num_blocks=16, budget=64, pipeline_parallel=False)
    add(scheduler, "a", 5)
    answer(scheduler, scheduler.schedule())
    (cached,) = scheduler.schedule().scheduled_cached_reqs
    assert cached.new_token_ids == []


def test_a_request_in_a_step_under_way_is_preempted_only_once_its_step_is_back():
    # 3 blocks of 4 tokens; "low" (priority 5) runs first, then "high" (priority 0).
    scheduler = make_scheduler(num_blocks=3, budget=64, policy="priority")
    add(scheduler, "low", 4, priority=5)
    answer(scheduler, scheduler.schedule())
    add(scheduler, "high", 4, priority=0, first_token=50)
    answer(scheduler, scheduler.schedule())  # low's decode takes block 2, high's prompt block 3
    # A budget of one token: low's decode goes (it runs first); high's decode, which needs a
    # fourth block, does not fit the budget.
    scheduler.config.max_num_batched_tokens = 1
    under_way = scheduler.schedule()
    assert under_way.num_scheduled_tokens == {"low": 1}
    scheduler.config.max_num_batched_tokens = 64
    # high needs a block and low is the victim, but low's step is under way: nobody is
    # preempted, high waits.
    waiting = scheduler.schedule()
    assert waiting.is_empty and not waiting.preempted_req_ids
    assert scheduler.requests["low"].status == RequestStatus.RUNNING
    answer(scheduler, under_way)
    answer(scheduler, waiting)
    # Its step is back: low is preempted for high.
    output = scheduler.schedule()
    assert output.preempted_req_ids == {"low"}
    assert output.num_scheduled_tokens == {"high": 1}
    assert scheduler.requests["low"].status == RequestStatus.PREEMPTED
    answer(scheduler, output)
