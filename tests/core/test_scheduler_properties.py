"""Random add / step / abort sequences against the scheduler and KV cache manager.

The model is replaced by a stand-in that returns a token from a tiny vocabulary, so
prefixes collide often and the small KV cache forces preemptions.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenserve.config import CacheConfig, SchedulerConfig
from tokenserve.core.request import Request, RequestStatus
from tokenserve.core.scheduler import Scheduler
from tokenserve.messages.model_runner_output import ModelRunnerOutput
from tokenserve.sampling_params import SamplingParams

from .invariants import check_block_pool_invariants

BLOCK_SIZE = 4
VOCAB = 3

prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)
actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), prompts, st.integers(1, 12), st.sampled_from([None, "s"])),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    min_size=1,
    max_size=40,
)


def run_step(scheduler: Scheduler, step_index: int) -> None:
    budget = scheduler.config.max_num_batched_tokens
    decode_rows = [
        r.request_id for r in scheduler.running if r.num_tokens - r.num_computed_tokens == 1
    ]
    output = scheduler.schedule()
    assert output.total_num_scheduled_tokens <= budget
    # Admission and preemption never share a step, and a preempted request is not in it.
    assert not (output.preempted_req_ids and output.scheduled_new_reqs)
    assert not output.preempted_req_ids & output.num_scheduled_tokens.keys()
    if not output.preempted_req_ids:
        # Decode rows first: each gets its token (as far as the budget goes), wherever it
        # stands among the running requests.
        served = [rid for rid in decode_rows if output.num_scheduled_tokens.get(rid) == 1]
        assert served == decode_rows[:budget]
    sampled = {}
    for request_id in output.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        # The computed count never passes the target, and a request is sampled only
        # once it reaches it.
        assert request.num_computed_tokens <= request.num_tokens
        if request.num_computed_tokens == request.num_tokens:
            sampled[request_id] = [(step_index + len(request_id)) % VOCAB]
    scheduler.update_from_output(output, ModelRunnerOutput(list(sampled), list(sampled.values())))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=actions,
    num_blocks=st.integers(9, 16),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
    policy=st.sampled_from(["fcfs", "priority"]),
    prefill_order=st.sampled_from(["shortest", "arrival"]),
    caching=st.booleans(),
    lookahead=st.sampled_from([0, 4, 256]),
    long_prefill=st.sampled_from([0, 1, 5]),
    share=st.sampled_from([0, 0.5, 1]),
)
def test_random_workloads_keep_block_pool_invariants(
    actions, num_blocks, budget, max_num_seqs, policy, prefill_order, caching, lookahead,
    long_prefill, share,
):
    max_model_len = 32  # 8 blocks: every request fits alone in the smallest cache
    scheduler = Scheduler(
        SchedulerConfig(
            budget, max_num_seqs, max_model_len, True, policy, prefill_order=prefill_order,
            admission_lookahead_tokens=lookahead, long_prefill_token_threshold=long_prefill,
            oldest_prompt_share=share,
        ),
        CacheConfig(BLOCK_SIZE, num_blocks, caching, "sha256"),
    )
    added: list[str] = []
    step_index = 0
    for action in actions:
        if action[0] == "add":
            _, tokens, max_tokens, salt = action
            request_id = f"r{len(added)}"
            scheduler.add_request(
                Request(request_id, tokens, SamplingParams(max_tokens=max_tokens), eos_token_id=None,
                        priority=len(added) % 3, cache_salt=salt)
            )
            added.append(request_id)
        elif action[0] == "step":
            for _ in range(action[1]):
                run_step(scheduler, step_index)
                step_index += 1
        elif added:
            scheduler.finish_requests([added[action[1] % len(added)]], RequestStatus.FINISHED_ABORTED)
        check_block_pool_invariants(scheduler.kv_cache_manager)

    # Drain: everything left must finish (nothing waits forever) and free its blocks.
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        run_step(scheduler, step_index)
        step_index += 1
        check_block_pool_invariants(scheduler.kv_cache_manager)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == num_blocks
    assert not scheduler.kv_cache_manager.req_to_blocks


@st.composite
def crowded_workloads(draw):
    """Requests that together need several times the KV cache, as
    (arrival step, prompt, max_tokens)."""
    max_model_len = 32
    requests = []
    for _ in range(draw(st.integers(3, 10))):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_model_len - 4))
        max_tokens = draw(st.integers(1, max_model_len - len(prompt)))
        requests.append((draw(st.integers(0, 12)), prompt, max_tokens))
    return sorted(requests, key=lambda request: request[0])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workload=crowded_workloads(),
    num_blocks=st.integers(8, 11),
    budget=st.integers(1, 16),
    max_num_seqs=st.integers(2, 8),
    policy=st.sampled_from(["fcfs", "priority"]),
    prefill_order=st.sampled_from(["shortest", "arrival"]),
    caching=st.booleans(),
    lookahead=st.sampled_from([0, 4, 256]),
    share=st.sampled_from([0, 0.5, 1]),
)
def test_under_kv_pressure_every_request_finishes_and_blocks_stay_consistent(
    workload, num_blocks, budget, max_num_seqs, policy, prefill_order, caching, lookahead, share
):
    scheduler = Scheduler(
        SchedulerConfig(budget, max_num_seqs, 32, True, policy, prefill_order=prefill_order,
                        admission_lookahead_tokens=lookahead, oldest_prompt_share=share),
        CacheConfig(BLOCK_SIZE, num_blocks, caching, "sha256"),
    )
    pending = list(enumerate(workload))
    for step_index in range(3000):
        while pending and pending[0][1][0] <= step_index:
            index, (_, prompt, max_tokens) = pending.pop(0)
            scheduler.add_request(
                Request(f"r{index}", prompt, SamplingParams(max_tokens=max_tokens),
                        eos_token_id=None, priority=index % 3)
            )
        if not pending and not scheduler.has_unfinished_requests():
            break
        run_step(scheduler, step_index)
        check_block_pool_invariants(scheduler.kv_cache_manager)
    assert not pending and not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == num_blocks
