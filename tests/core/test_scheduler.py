"""Scheduler behaviour on hand-built cases (the model replaced by fixed tokens)."""

from __future__ import annotations

from tokenserve.config import CacheConfig, SchedulerConfig
from tokenserve.core.request import Request, RequestStatus
from tokenserve.core.scheduler import Scheduler
from tokenserve.messages.model_runner_output import ModelRunnerOutput
from tokenserve.sampling_params import SamplingParams

from .invariants import check_block_pool_invariants


def make_scheduler(num_blocks=8, budget=64, max_num_seqs=8, policy="fcfs", block_size=4):
    # These tests drive preemption, which admission lookahead (test_kv_lookahead.py) avoids.
    return Scheduler(
        SchedulerConfig(budget, max_num_seqs, num_blocks * block_size, True, policy,
                        admission_lookahead_tokens=0),
        CacheConfig(block_size, num_blocks, True, "sha256"),
    )


def add(scheduler, request_id, num_tokens, max_tokens=8, priority=0, first_token=0):
    request = Request(
        request_id,
        list(range(first_token, first_token + num_tokens)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_id=None,
        priority=priority,
    )
    scheduler.add_request(request)
    return request


def step(scheduler):
    output = scheduler.schedule()
    sampled = {
        rid: [1]
        for rid in output.num_scheduled_tokens
        if scheduler.requests[rid].num_computed_tokens == scheduler.requests[rid].num_tokens
    }
    scheduler.update_from_output(output, ModelRunnerOutput(list(sampled), list(sampled.values())))
    check_block_pool_invariants(scheduler.kv_cache_manager)
    return output


def test_long_prompt_is_chunked_and_decodes_share_the_step():
    scheduler = make_scheduler(num_blocks=32, budget=8)
    add(scheduler, "short", 3)
    step(scheduler)  # prefill of "short"
    add(scheduler, "long", 20, first_token=100)
    output = step(scheduler)
    # The decode of "short" goes first, the rest of the budget goes to a chunk of "long".
    assert output.num_scheduled_tokens == {"short": 1, "long": 7}
    output = step(scheduler)
    assert output.num_scheduled_tokens == {"short": 1, "long": 7}


def test_long_prefill_token_threshold_caps_each_prompt_per_step():
    scheduler = Scheduler(
        SchedulerConfig(64, 8, 128, True, "fcfs", admission_lookahead_tokens=0,
                        long_prefill_token_threshold=8),
        CacheConfig(4, 32, True, "sha256"),
    )
    add(scheduler, "short", 3)
    add(scheduler, "long", 20, first_token=100)
    # Each prompt gets at most 8 tokens a step, though the budget of 64 would hold both.
    assert step(scheduler).num_scheduled_tokens == {"short": 3, "long": 8}
    assert step(scheduler).num_scheduled_tokens == {"short": 1, "long": 8}
    assert step(scheduler).num_scheduled_tokens == {"short": 1, "long": 4}
    # A new prompt is capped at admission too; decode rows never are.
    add(scheduler, "next", 12, first_token=200)
    assert step(scheduler).num_scheduled_tokens == {"short": 1, "long": 1, "next": 8}
    assert step(scheduler).num_scheduled_tokens == {"short": 1, "long": 1, "next": 4}
    # A request alone delays nobody: its prompt takes the budget.
    for _ in range(8):
        step(scheduler)
    assert not scheduler.running and not scheduler.waiting
    add(scheduler, "alone", 20, first_token=300)
    assert step(scheduler).num_scheduled_tokens == {"alone": 20}


def test_no_admission_in_a_step_that_preempted():
    scheduler = make_scheduler(num_blocks=4, budget=64, block_size=4)
    add(scheduler, "a", 8, max_tokens=8)  # 2 blocks
    add(scheduler, "b", 8, max_tokens=8, first_token=50)  # 2 blocks: the pool is full
    step(scheduler)
    add(scheduler, "c", 2, first_token=90)
    output = step(scheduler)  # "a" needs a third block: "b" (the newest) is preempted
    assert output.preempted_req_ids == {"b"}
    assert output.scheduled_new_reqs == []
    assert scheduler.requests["b"].status == RequestStatus.PREEMPTED
    assert scheduler.requests["c"].status == RequestStatus.WAITING
    # The preempted request goes back to the front of the queue, before "c".
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 4


def test_priority_policy_admits_and_preempts_by_priority():
    scheduler = make_scheduler(num_blocks=4, budget=64, max_num_seqs=1, policy="priority")
    add(scheduler, "low", 4, priority=5)
    add(scheduler, "high", 4, priority=0, first_token=50)
    output = step(scheduler)
    assert [r.request_id for r in output.scheduled_new_reqs] == ["high"]

    scheduler = make_scheduler(num_blocks=4, budget=64, policy="priority", block_size=4)
    add(scheduler, "important", 8, priority=0)
    add(scheduler, "background", 8, priority=9, first_token=50)
    step(scheduler)
    output = step(scheduler)
    # The pool is full; the lowest-priority request gives way, whatever its age.
    assert output.preempted_req_ids == {"background"}


def test_abort_frees_blocks_of_running_and_waiting_requests():
    scheduler = make_scheduler(num_blocks=8, budget=6)
    add(scheduler, "a", 10)
    add(scheduler, "b", 10, first_token=50)
    step(scheduler)  # "a" is running with a partial prefill; "b" waits
    scheduler.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    check_block_pool_invariants(scheduler.kv_cache_manager)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 8
    assert scheduler.schedule().finished_req_ids == {"a", "b"}


def test_request_waiting_for_its_grammar_keeps_its_place_and_others_go_first():
    for policy in ("fcfs", "priority"):
        scheduler = make_scheduler(policy=policy)
        compiling = add(scheduler, "compiling", 4)
        compiling.status = RequestStatus.WAITING_FOR_GRAMMAR  # as the engine core sets it
        add(scheduler, "ready", 4, first_token=50)
        output = step(scheduler)
        assert list(output.num_scheduled_tokens) == ["ready"]
        assert list(scheduler.waiting) == [compiling]
        compiling.status = RequestStatus.WAITING  # its grammar is compiled
        output = step(scheduler)
        assert set(output.num_scheduled_tokens) == {"ready", "compiling"}
