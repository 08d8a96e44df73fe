"""Admission that looks ahead at the running requests' KV growth (core/kv_lookahead.py)."""

from __future__ import annotations

import random

from tokenserve.config import CacheConfig, SchedulerConfig
from tokenserve.core.kv_lookahead import peak_blocks
from tokenserve.core.scheduler import Scheduler

from .test_scheduler import add, step


def _peak_by_stepping(lengths, remaining, block_size, lookahead) -> int:
    """The projection step by step: request i holds ceil((length + t) / block_size) blocks
    while t < remaining (through the window when it outlives it), none after."""
    peak = 0
    for t in range(lookahead + 1):
        held = 0
        for length, left in zip(lengths, remaining):
            if t < left or left >= lookahead:
                held += -(-(length + min(t, left, lookahead)) // block_size)
        peak = max(peak, held)
    return peak


def test_peak_counts_what_finished_requests_give_back():
    # A (20 tokens) finishes after 4 more; B (8 tokens) outlives the 16-step window.
    # Just before A finishes: 6 + 3 blocks; at the window's end B alone holds 6. Counting
    # both at their largest, as if neither finished, would say 12.
    assert peak_blocks([20, 8], [4, 100], block_size=4, lookahead=16) == 9
    assert peak_blocks([], [], block_size=4, lookahead=16) == 0


def test_peak_equals_the_projection_step_by_step():
    rng = random.Random(0)
    for _ in range(300):
        count = rng.randint(1, 6)
        lengths = [rng.randint(1, 40) for _ in range(count)]
        remaining = [rng.randint(0, 40) for _ in range(count)]
        block_size, lookahead = rng.choice([1, 4, 16]), rng.randint(1, 48)
        assert peak_blocks(lengths, remaining, block_size, lookahead) == _peak_by_stepping(
            lengths, remaining, block_size, lookahead
        ), (lengths, remaining, block_size, lookahead)


def _run(lookahead: int) -> tuple[Scheduler, int]:
    """Eight requests of 16 prompt + 16 output tokens on 32 blocks of 4 (128 tokens):
    four fit at their full length, eight fit only by their prompts. Returns the scheduler
    and the most requests that ran at once."""
    config = SchedulerConfig(64, 8, 128, True, "fcfs", admission_lookahead_tokens=lookahead)
    scheduler = Scheduler(config, CacheConfig(4, 32, True, "sha256"))
    for index in range(8):
        add(scheduler, str(index), 16, max_tokens=16, first_token=100 * index)
    most = 0
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler)
        most = max(most, len(scheduler.running))
    assert not scheduler.has_unfinished_requests()
    return scheduler, most


def test_lookahead_admits_only_what_can_grow_to_its_end():
    scheduler, most = _run(lookahead=16)
    assert scheduler.num_preemptions == 0
    assert most == 4


def test_without_lookahead_prompts_that_fit_are_admitted_and_preempted_later():
    scheduler, most = _run(lookahead=0)
    assert most > 4
    assert scheduler.num_preemptions > 0


def test_a_request_that_would_run_alone_is_admitted_even_if_it_cannot_grow_to_its_end():
    # 8 blocks of 4: each request may grow to the model length (32 tokens), past the pool's
    # reach with another one beside it. They run one after the other; none waits forever.
    config = SchedulerConfig(64, 8, 32, True, "fcfs", admission_lookahead_tokens=64)
    scheduler = Scheduler(config, CacheConfig(4, 8, True, "sha256"))
    add(scheduler, "a", 8, max_tokens=100)
    add(scheduler, "b", 8, max_tokens=100, first_token=50)
    step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a"]
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_preemptions == 0
