"""The scheduler under a target step time (--target-step-ms), with the model replaced by fixed
tokens and the clock by a synthetic step cost: no test here depends on the machine's speed."""

from __future__ import annotations

import random

import pytest

from tokenserve.config import CacheConfig, SchedulerConfig
from tokenserve.core.request import Request, RequestStatus
from tokenserve.core.scheduler import MIN_PREFILL_TOKENS, Scheduler
from tokenserve.core.step_cost import StepCostModel, StepShape
from tokenserve.messages.model_runner_output import ModelRunnerOutput
from tokenserve.sampling_params import SamplingParams

from .invariants import check_block_pool_invariants
from .test_scheduler import add
from .test_step_cost import random_shape, synthetic_seconds


def make_scheduler(
    target_step_ms: float | None,
    speed: float = 1.0,
    budget: int = 2048,
    num_blocks: int = 512,
    block_size: int = 16,
    max_num_seqs: int = 32,
    chunked: bool = True,
) -> Scheduler:
    """A scheduler whose cost model has already seen 30 steps at `speed` (synthetic times)."""
    cost_model = StepCostModel()
    rng = random.Random(0)
    for _ in range(30):
        shape = random_shape(rng)
        cost_model.record(shape, synthetic_seconds(shape, speed=speed))
    return Scheduler(
        # The scenarios preempt, which admission lookahead (test_kv_lookahead.py) avoids.
        SchedulerConfig(
            budget, max_num_seqs, num_blocks * block_size, chunked, "fcfs", target_step_ms,
            admission_lookahead_tokens=0,
        ),
        CacheConfig(block_size, num_blocks, True, "sha256"),
        step_cost_model=cost_model if target_step_ms is not None else None,
    )


def step(scheduler: Scheduler, speed: float = 1.0):
    """Schedule, "execute" (fixed tokens), update; the step took its synthetic time at `speed`."""
    decode_rows = {
        r.request_id for r in scheduler.running if r.num_tokens - r.num_computed_tokens == 1
    }
    output = scheduler.schedule()
    sampled = {
        rid: [1]
        for rid in output.num_scheduled_tokens
        if scheduler.requests[rid].num_computed_tokens == scheduler.requests[rid].num_tokens
    }
    scheduler.update_from_output(output, ModelRunnerOutput(list(sampled), list(sampled.values())))
    check_block_pool_invariants(scheduler.kv_cache_manager)
    if scheduler.step_cost_model is not None and not output.is_empty:
        shape = StepShape.of(output)
        scheduler.step_cost_model.record(shape, synthetic_seconds(shape, speed=speed))
    return output, decode_rows


def run_until_prefilled(scheduler: Scheduler, request_id: str, speed: float = 1.0, limit=1000):
    """Step until `request_id` has computed its prompt; its chunk sizes, and the outputs."""
    chunks, outputs = [], []
    request = scheduler.requests[request_id]
    for _ in range(limit):
        output, decode_rows = step(scheduler, speed)
        outputs.append((output, decode_rows))
        if request_id in output.num_scheduled_tokens:
            chunks.append(output.num_scheduled_tokens[request_id])
        if request.num_computed_tokens >= request.num_prompt_tokens:
            return chunks, outputs
    raise AssertionError(f"{request_id} did not finish its prompt in {limit} steps")


def start_decoders(scheduler: Scheduler, count: int, prompt_len: int = 8, speed: float = 1.0):
    for index in range(count):
        add(scheduler, f"decode-{index}", prompt_len, max_tokens=400, first_token=1000 + 50 * index)
    while any(r.status != RequestStatus.RUNNING or r.num_output_tokens == 0
              for r in scheduler.requests.values()):
        step(scheduler, speed)


def test_decodes_always_advance_and_prefill_gets_the_minimum_when_decodes_fill_the_target():
    # Target 1 ms: below the 2 ms fixed cost of any step.
    scheduler = make_scheduler(target_step_ms=1.0)
    start_decoders(scheduler, 12)
    add(scheduler, "long", 1000, first_token=5000)
    chunks, outputs = run_until_prefilled(scheduler, "long")
    for output, decode_rows in outputs:
        assert len(decode_rows) == 12
        assert all(output.num_scheduled_tokens[rid] == 1 for rid in decode_rows)
    # Prefill never starves: the minimum every step, until the prompt is done.
    full_chunks, rest = divmod(1000, MIN_PREFILL_TOKENS)
    assert chunks == [MIN_PREFILL_TOKENS] * full_chunks + [rest]
    assert scheduler.make_stats().token_budget == 12 + MIN_PREFILL_TOKENS


@pytest.mark.parametrize("speed", [0.25, 1.0, 4.0, 16.0])
def test_chunks_fill_what_the_target_leaves(speed):
    target_ms = 10.0
    budget = 2048
    scheduler = make_scheduler(target_ms, speed=speed, budget=budget)
    start_decoders(scheduler, 4, speed=speed)
    add(scheduler, "long", 3000, first_token=5000)
    chunks, outputs = run_until_prefilled(scheduler, "long", speed=speed)
    assert sum(chunks) == 3000
    for (output, decode_rows), chunk in zip(outputs, chunks):
        assert all(output.num_scheduled_tokens[rid] == 1 for rid in decode_rows)
        assert MIN_PREFILL_TOKENS <= chunk <= budget - len(decode_rows) or chunk == chunks[-1]
        step_ms = synthetic_seconds(StepShape.of(output), speed=speed) * 1e3
        if chunk > MIN_PREFILL_TOKENS:
            assert step_ms <= target_ms * (1 + 1e-6)
            if chunk < budget - len(decode_rows) and chunk != chunks[-1]:
                # As large as fits: one more token would have missed the target.
                assert step_ms > target_ms * 0.97
    if speed == 0.25:
        assert chunks[0] == budget - 4  # fast steps: max_num_batched_tokens bounds the chunk
    if speed == 16.0:
        assert chunks[:-1] == [MIN_PREFILL_TOKENS] * (len(chunks) - 1)  # slow: the minimum


def test_chunks_follow_the_step_cost_when_it_changes():
    """The machine gets 3x slower, then 6x faster: within a few steps the model has learned
    the new cost from the steps it recorded, and steps are back at the target."""
    target_ms = 10.0
    scheduler = make_scheduler(target_ms, speed=1.0, num_blocks=2048, max_num_seqs=8)
    start_decoders(scheduler, 4)
    add(scheduler, "long", 30000, first_token=5000)
    request = scheduler.requests["long"]
    chunks: dict[float, list[int]] = {}
    for speed in (1.0, 3.0, 0.5):
        step_times = []
        for _ in range(12):
            output, _ = step(scheduler, speed)
            chunks.setdefault(speed, []).append(output.num_scheduled_tokens["long"])
            step_times.append(synthetic_seconds(StepShape.of(output), speed=speed) * 1e3)
        assert step_times[-1] == pytest.approx(target_ms, rel=0.05), (speed, step_times)
    assert chunks[3.0][-1] < chunks[1.0][-1] / 2  # slower steps: smaller chunks
    assert chunks[0.5][-1] > chunks[3.0][-1] * 2  # faster steps: larger ones
    assert request.num_computed_tokens < 30000


def test_prefill_of_many_prompts_completes_under_a_tight_target():
    # The target (0.5 ms: below any step's fixed cost) holds prefill to the minimum except
    # in steps that would leave a waiting request it could admit without a token: those
    # take the full budget, as without a target (a backlog is not starved).
    scheduler = make_scheduler(target_step_ms=0.5, num_blocks=256, max_num_seqs=8)
    rng = random.Random(7)
    for index in range(10):
        add(scheduler, f"r{index}", rng.randint(1, 120), max_tokens=5, first_token=100 * index)
    full_steps = 0
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        room = scheduler.config.max_num_seqs - len(scheduler.running)
        could_admit = room > 0 and len(scheduler.waiting) > 0
        output, _ = step(scheduler)
        prefill = sum(n for rid, n in output.num_scheduled_tokens.items() if n > 1)
        if prefill > MIN_PREFILL_TOKENS:
            assert could_admit and scheduler.make_stats().token_budget == 2048
            full_steps += 1
    assert full_steps >= 1
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 256


def test_without_chunked_prefill_the_first_prompt_of_a_step_goes_whole():
    # The first prompt goes whole under any target; the second would get nothing under
    # this one, so the step takes the full budget (512: two 200-token prompts, not three).
    scheduler = make_scheduler(target_step_ms=0.5, chunked=False, budget=512, max_num_seqs=8)
    for index in range(4):
        add(scheduler, f"r{index}", 200, max_tokens=3, first_token=300 * index)
    admitted = []
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        output, _ = step(scheduler)
        admitted.append([r.request_id for r in output.scheduled_new_reqs])
        assert all(n in (1, 200) for n in output.num_scheduled_tokens.values())
    assert not scheduler.has_unfinished_requests()
    assert [ids for ids in admitted if ids] == [["r0", "r1"], ["r2", "r3"]]


def test_a_backlog_takes_full_steps_and_a_lone_prompt_the_target():
    target_ms, budget = 10.0, 2048
    scheduler = make_scheduler(target_ms, budget=budget, num_blocks=2048, max_num_seqs=32)
    start_decoders(scheduler, 4)
    # A lone long prompt beside the decodes: its chunks keep each step within the target.
    add(scheduler, "long", 3000, first_token=5000)
    for _ in range(3):
        output, _ = step(scheduler)
        assert synthetic_seconds(StepShape.of(output)) * 1e3 <= target_ms * (1 + 1e-6)
        assert scheduler.make_stats().token_budget < budget
    # Twenty prompts arrive at once: the target would leave most of them without a token,
    # so the first step takes the whole budget, and all have started after the second
    # (3,000 prompt tokens; the target alone grants ~700 a step here).
    for index in range(20):
        add(scheduler, f"burst-{index}", 150, max_tokens=5, first_token=7000 + 10 * index)
    output, _ = step(scheduler)
    assert output.total_num_scheduled_tokens == budget
    assert scheduler.make_stats().token_budget == budget
    step(scheduler)
    assert not any(r.status == RequestStatus.WAITING for r in scheduler.requests.values())
    # Once they all run, the long prompt's chunks are held to the target again.
    for _ in range(3):
        output, _ = step(scheduler)
        prefill = output.num_scheduled_tokens.get("long", 0)
        if prefill > MIN_PREFILL_TOKENS:
            assert synthetic_seconds(StepShape.of(output)) * 1e3 <= target_ms * (1 + 1e-6)


def random_schedule(scheduler: Scheduler, seed: int) -> list[tuple]:
    """A random arrival pattern (chunking, prefix hits, preemption); what each step decided."""
    rng = random.Random(seed)
    decisions = []
    for index in range(200):
        if index < 60 and rng.random() < 0.3:
            prefix = [] if rng.random() < 0.5 else list(range(48))  # prefix-cache hits
            unique = list(range(1000 + 400 * index, 1000 + 400 * index + rng.randint(1, 300)))
            params = SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True)
            scheduler.add_request(Request(f"r{index}", prefix + unique, params, eos_token_id=None))
        output, _ = step(scheduler)
        decisions.append(
            (dict(output.num_scheduled_tokens), sorted(output.preempted_req_ids))
        )
    return decisions


@pytest.mark.parametrize("seed", range(3))
def test_without_a_target_or_with_an_unreachable_one_scheduling_is_unchanged(seed):
    settings = {"budget": 64, "num_blocks": 30, "max_num_seqs": 6}
    untargeted = make_scheduler(None, **settings)
    assert untargeted.step_cost_model is None
    reference = random_schedule(untargeted, seed)
    stats = untargeted.make_stats()
    assert stats.token_budget == 64 and stats.predicted_step_ms is None
    assert sum(len(preempted) for _, preempted in reference) > 0  # the scenario preempts
    assert any(64 in steps.values() for steps, _ in reference)  # and chunks
    # A target no step can miss leaves every decision as it was.
    assert random_schedule(make_scheduler(1e12, **settings), seed) == reference
