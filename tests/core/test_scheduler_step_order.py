"""How a step is composed: decode rows first, then prompt chunks, shortest remaining prompt
first under the fcfs policy (or by arrival with prefill_order="arrival"). The model is
replaced by fixed tokens."""

from __future__ import annotations

import pytest

from tokenserve.config import CacheConfig, SchedulerConfig
from tokenserve.core.request import RequestStatus
from tokenserve.core.scheduler import Scheduler

from .invariants import check_block_pool_invariants
from .test_scheduler import add, step


def make_scheduler(
    budget: int,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    policy: str = "fcfs",
    prefill_order: str = "shortest",
    chunked: bool = True,
    caching: bool = True,
    oldest_prompt_share: float = 0.5,
) -> Scheduler:
    # These tests drive preemption, which admission lookahead (test_kv_lookahead.py) avoids.
    config = SchedulerConfig(budget, max_num_seqs, num_blocks * block_size, chunked, policy,
                             admission_lookahead_tokens=0,
                             oldest_prompt_share=oldest_prompt_share)
    config.prefill_order = prefill_order
    return Scheduler(config, CacheConfig(block_size, num_blocks, caching, "sha256"))


def drain(scheduler: Scheduler, limit: int = 500) -> None:
    for _ in range(limit):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler)
    assert not scheduler.has_unfinished_requests()
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_a_short_request_is_admitted_beside_a_long_prompt_and_gets_its_whole_prompt():
    scheduler = make_scheduler(budget=16)
    add(scheduler, "long", 100)
    assert step(scheduler).num_scheduled_tokens == {"long": 16}
    add(scheduler, "short", 5, first_token=500)
    output = step(scheduler)
    # The short prompt goes whole in the step it arrives; the long one gets the rest.
    assert [r.request_id for r in output.scheduled_new_reqs] == ["short"]
    assert output.num_scheduled_tokens == {"short": 5, "long": 11}
    assert scheduler.requests["short"].num_output_tokens == 1
    # From then on the short request decodes in every step beside the long prompt's chunks.
    for _ in range(3):
        assert step(scheduler).num_scheduled_tokens == {"short": 1, "long": 15}
    drain(scheduler)


def test_a_decode_row_behind_a_long_prompt_in_running_still_gets_its_token():
    scheduler = make_scheduler(budget=8)
    add(scheduler, "long", 40)
    step(scheduler)  # long: 8 of 40
    add(scheduler, "short", 3, first_token=500)
    step(scheduler)  # short is admitted after long: it stands behind it in `running`
    assert [r.request_id for r in scheduler.running] == ["long", "short"]
    # long alone could fill the budget (27 tokens left); the decode row goes first anyway.
    assert step(scheduler).num_scheduled_tokens == {"short": 1, "long": 7}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("prefill_order", ["shortest", "arrival"])
def test_decode_rows_go_first_whatever_their_place_in_running(policy, prefill_order):
    scheduler = make_scheduler(budget=8, policy=policy, prefill_order=prefill_order)
    add(scheduler, "decoding", 3)
    step(scheduler)
    add(scheduler, "long", 40, first_token=100)
    step(scheduler)
    # The order `running` takes when a short request is admitted beside a long prompt
    # (as shortest-first does); put in place here so every policy and order sees it.
    scheduler.running.reverse()
    assert [r.request_id for r in scheduler.running] == ["long", "decoding"]
    for _ in range(3):
        assert step(scheduler).num_scheduled_tokens == {"decoding": 1, "long": 7}


def test_with_arrival_order_the_short_request_waits_for_the_long_prompt():
    scheduler = make_scheduler(budget=16, prefill_order="arrival")
    add(scheduler, "long", 100)
    step(scheduler)
    add(scheduler, "short", 5, first_token=500)
    chunks = []
    while scheduler.requests["long"].num_computed_tokens < 100:
        output = step(scheduler)
        chunks.append(output.num_scheduled_tokens)
        if scheduler.requests["long"].num_computed_tokens < 100:
            assert output.num_scheduled_tokens == {"long": 16}
    # The short prompt only gets what the long prompt's last chunk leaves.
    assert chunks[-1] == {"long": 4, "short": 5}
    assert scheduler.requests["short"].status == RequestStatus.RUNNING
    drain(scheduler)


def test_prompts_of_one_length_are_admitted_in_arrival_order():
    scheduler = make_scheduler(budget=16)
    for request_id in ("c", "a", "d", "b"):  # not alphabetical, to rule out any id order
        add(scheduler, request_id, 10, max_tokens=2, first_token=100 * ord(request_id))
    admitted = []
    for _ in range(10):
        output = step(scheduler)
        admitted += [r.request_id for r in output.scheduled_new_reqs]
    assert admitted == ["c", "a", "d", "b"]


def test_shorter_prompts_go_first_and_ties_keep_arrival_order():
    scheduler = make_scheduler(budget=64)
    add(scheduler, "long", 30)
    add(scheduler, "mid", 20, first_token=100)
    add(scheduler, "short", 5, first_token=200)
    add(scheduler, "short-too", 5, first_token=300)
    output = step(scheduler)
    assert [r.request_id for r in output.scheduled_new_reqs] == [
        "short", "short-too", "mid", "long"
    ]
    assert output.num_scheduled_tokens == {"short": 5, "short-too": 5, "mid": 20, "long": 30}


@pytest.mark.parametrize(
    "share, expected",
    [
        (0.5, {"long": 10, "short": 9}),  # ceil(0.5 * 19) held for "long"
        (0.25, {"long": 5, "short": 10, "short-too": 4}),
        (0, {"short": 10, "short-too": 9}),  # shortest first alone
    ],
)
def test_the_oldest_prompt_is_held_its_share_of_the_prompt_tokens(share, expected):
    scheduler = make_scheduler(budget=20, oldest_prompt_share=share)
    add(scheduler, "long", 200, max_tokens=1)
    add(scheduler, "decoder", 2, max_tokens=100, first_token=900)
    assert step(scheduler).num_scheduled_tokens == {"decoder": 2, "long": 18}
    add(scheduler, "short", 10, first_token=1000)
    add(scheduler, "short-too", 10, first_token=1100)
    # One decode row, then 19 prompt tokens: the shorter prompts first, from what the share
    # held for the oldest prompt leaves them.
    assert step(scheduler).num_scheduled_tokens == {"decoder": 1, **expected}
    drain(scheduler)


@pytest.mark.parametrize("share", [0.5, 0])
def test_short_prompts_arriving_every_step_do_not_hold_the_oldest_back(share):
    scheduler = make_scheduler(budget=20, oldest_prompt_share=share)
    long = add(scheduler, "long", 100, max_tokens=1)
    step(scheduler)  # alone, it takes the whole budget
    for i in range(30):
        add(scheduler, f"short{i}", 20, max_tokens=1, first_token=1000 + 20 * i)
        step(scheduler)
        if long.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            break
    if share:
        # 10 tokens a step for six steps; then its last 20 tie with the new short prompt and
        # go first, as the older.
        assert i == 6
    else:
        assert long.num_computed_tokens == 20  # every step went to the short prompts
    drain(scheduler)


def test_the_oldest_prompt_first_in_order_takes_the_rest_of_the_budget_as_before():
    # Prompts of one length: the oldest comes first anyway, and nothing is held back.
    for share in (0, 0.5):
        scheduler = make_scheduler(budget=30, oldest_prompt_share=share)
        for i in range(3):
            add(scheduler, f"r{i}", 12, first_token=100 * i)
        assert step(scheduler).num_scheduled_tokens == {"r0": 12, "r1": 12, "r2": 6}
        drain(scheduler)


def test_a_preempted_request_keeps_its_place_ahead_of_fresh_prompts_of_its_length():
    scheduler = make_scheduler(budget=64, num_blocks=4)
    add(scheduler, "a", 8, max_tokens=6)  # 2 blocks
    add(scheduler, "b", 8, max_tokens=6, first_token=50)  # 2 blocks: the pool is full
    step(scheduler)
    add(scheduler, "c", 8, first_token=90)
    output = step(scheduler)  # "a" needs a third block: "b" (the newest) is preempted
    assert output.preempted_req_ids == {"b"}
    # "b" has 9 tokens to recompute, "c" 8: "b" still goes first, as first come first served.
    admitted = []
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        admitted += [r.request_id for r in step(scheduler).scheduled_new_reqs]
    assert admitted == ["b", "c"]


def test_a_preempted_request_does_not_go_ahead_of_the_running_prompt_it_gave_way_to():
    # Budget 1: a decode row takes the whole step. "decoder" cannot reach its 26 tokens
    # beside the blocks of "prompt" (mid-prompt, starved by the decode row), so it preempts
    # itself. Admitted again ahead of "prompt", it would decode, run out of blocks and
    # preempt itself again, forever; behind it, "prompt" finishes and frees its blocks.
    # (No prefix caching: a cache hit would make the recompute too cheap to show it. No
    # share held for the oldest prompt: with the whole budget of 1 held for "prompt",
    # "decoder" would not be admitted before it finished, and nothing would be preempted.)
    scheduler = make_scheduler(budget=1, num_blocks=8, caching=False, oldest_prompt_share=0)
    add(scheduler, "first", 5, max_tokens=1)
    add(scheduler, "prompt", 7, max_tokens=1, first_token=100)
    for _ in range(10):
        step(scheduler)
    add(scheduler, "decoder", 1, max_tokens=25, first_token=200)
    preempted = []
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        preempted += step(scheduler).preempted_req_ids
    assert preempted == ["decoder"]
    assert not scheduler.has_unfinished_requests()


def test_the_priority_policy_keeps_priority_order_for_prompts():
    scheduler = make_scheduler(budget=16, policy="priority")
    add(scheduler, "long", 100, priority=1)
    step(scheduler)
    add(scheduler, "short", 5, priority=1, first_token=500)
    # A started prompt goes before a waiting one of the same priority, however short.
    assert step(scheduler).num_scheduled_tokens == {"long": 16}
    add(scheduler, "urgent-long", 60, priority=0, first_token=700)
    add(scheduler, "later-short", 4, priority=2, first_token=900)
    # Waiting requests go by priority, not by length.
    scheduler.finish_requests(["long"], RequestStatus.FINISHED_ABORTED)
    output = step(scheduler)
    assert output.num_scheduled_tokens == {"urgent-long": 16}
    drain(scheduler)


def test_preempting_a_decode_row_already_scheduled_gives_its_token_back():
    # 8 blocks of 4 slots. "short" is admitted beside "long"'s prompt and decodes in front
    # of it; when "long"'s next chunk finds no free block, the newest running request
    # ("short", already scheduled this step) is preempted for it.
    scheduler = make_scheduler(budget=8, num_blocks=8)
    add(scheduler, "long", 28, max_tokens=2)
    step(scheduler)  # long 8
    add(scheduler, "short", 3, max_tokens=8, first_token=500)
    assert step(scheduler).num_scheduled_tokens == {"short": 3, "long": 5}
    assert step(scheduler).num_scheduled_tokens == {"short": 1, "long": 7}
    output = step(scheduler)
    assert output.preempted_req_ids == {"short"}
    assert output.num_scheduled_tokens == {"long": 7}
    assert output.total_num_scheduled_tokens == 7
    assert [c.request_id for c in output.scheduled_cached_reqs] == ["long"]
    assert output.scheduled_new_reqs == []
    assert scheduler.requests["short"].num_computed_tokens == 0
    drain(scheduler)


def test_priority_victim_already_scheduled_is_not_in_the_step():
    scheduler = make_scheduler(budget=64, num_blocks=4, policy="priority")
    add(scheduler, "low", 6, priority=9)
    step(scheduler)
    add(scheduler, "high", 8, priority=0, first_token=50)
    step(scheduler)  # the pool is full: "low" 2 blocks, "high" 2 blocks
    output = step(scheduler)
    # "low" (first in running) fits its decode; "high" needs a block, and "low" gives way.
    assert output.preempted_req_ids == {"low"}
    assert output.num_scheduled_tokens == {"high": 1}
    assert [c.request_id for c in output.scheduled_cached_reqs] == ["high"]
    drain(scheduler)


def test_a_running_prompt_after_an_admission_does_not_preempt():
    # 6 blocks of 4 slots. "long" holds 4 blocks mid-prompt and its next chunk needs 2 more;
    # "short" needs 1. Shortest first, "short" is admitted and takes one of the 2 free
    # blocks; "long" then waits for the next step instead of preempting it.
    scheduler = make_scheduler(budget=8, num_blocks=6)
    add(scheduler, "long", 22, max_tokens=2)
    step(scheduler)
    step(scheduler)  # long: 16 of 22, 4 blocks
    add(scheduler, "short", 3, max_tokens=1, first_token=500)
    output = step(scheduler)
    assert output.num_scheduled_tokens == {"short": 3}
    assert output.preempted_req_ids == set()
    assert step(scheduler).num_scheduled_tokens == {"long": 6}  # "short" finished
    drain(scheduler)


def test_without_chunked_prefill_no_prompt_is_split_and_a_misfit_ends_admission():
    scheduler = make_scheduler(budget=16, chunked=False)
    add(scheduler, "a", 10)
    add(scheduler, "b", 12, first_token=100)
    add(scheduler, "c", 5, first_token=200)
    output = step(scheduler)
    # c (5) then a (10) fit; b (12) does not fit the 1 token left and waits whole.
    assert output.num_scheduled_tokens == {"c": 5, "a": 10}
    output = step(scheduler)
    assert output.num_scheduled_tokens == {"c": 1, "a": 1, "b": 12}
    drain(scheduler)


def test_a_bad_prefill_order_is_refused():
    with pytest.raises(ValueError, match="prefill_order"):
        make_scheduler(budget=8, prefill_order="longest")


def test_block_pool_invariants_hold_through_a_mixed_workload():
    scheduler = make_scheduler(budget=12, num_blocks=12)
    for index, length in enumerate((30, 3, 17, 5, 40, 2, 9)):
        add(scheduler, f"r{index}", length, max_tokens=5, first_token=100 * index)
        step(scheduler)
    check_block_pool_invariants(scheduler.kv_cache_manager)
    drain(scheduler)
