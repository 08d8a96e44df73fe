"""The simulator: the real scheduler on a virtual clock, under a fixed cost model.

The cost model is a cost.json written here (never a live calibration), so nothing depends
on the host's speed; the assertions are about behaviour: prefix hits on shared ids,
preemptions under a small KV cache, bench serve's keys, virtual times that follow the model.
"""

from __future__ import annotations

import json

import pytest

from tokenserve.benchmarks import mooncake
from tokenserve.benchmarks.openai_client import RequestResult
from tokenserve.benchmarks.serve_metrics import summarize
from tokenserve.config import CacheConfig, SchedulerConfig
from tokenserve.core.step_cost import StepCostModel
from tokenserve.metrics.request_trace import TRACE_BLOCK_SIZE, TraceEntry
from tokenserve.simulator.calibrate import read_cost_file
from tokenserve.simulator.simulate import simulate

VOCAB = 1000
COST = {"intercept_ms": 5.0, "ms_per_1k_tokens": 50.0, "ms_per_1m_attention_pairs": 10.0}


@pytest.fixture
def cost_model(tmp_path) -> StepCostModel:
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(COST))
    return read_cost_file(str(path))


def configs(num_blocks: int = 512, block_size: int = 16, budget: int = 512, caching: bool = True,
            max_num_seqs: int = 64, lookahead: int = 256) -> tuple[SchedulerConfig, CacheConfig]:
    return (
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                        max_model_len=4096, enable_chunked_prefill=True, policy="fcfs",
                        admission_lookahead_tokens=lookahead),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching,
                    prefix_caching_hash_algo="sha256"),
    )


def shared_prefix_trace(count: int = 8) -> list[TraceEntry]:
    # Two shared 512-token blocks, then one block of the request's own.
    return [TraceEntry(i * 10, 3 * TRACE_BLOCK_SIZE - 100, 8, [0, 1, 100 + i]) for i in range(count)]


def test_shared_hash_ids_give_shared_prompt_prefixes():
    a, b = shared_prefix_trace(2)
    prompt_a = mooncake.prompt_token_ids(a, VOCAB, 0)
    prompt_b = mooncake.prompt_token_ids(b, VOCAB, 1)
    assert prompt_a == mooncake.prompt_token_ids(a, VOCAB, 0)  # deterministic
    assert len(prompt_a) == a.input_length
    assert prompt_a[:2 * TRACE_BLOCK_SIZE] == prompt_b[:2 * TRACE_BLOCK_SIZE]
    assert prompt_a[2 * TRACE_BLOCK_SIZE:] != prompt_b[2 * TRACE_BLOCK_SIZE:]
    # Tokens past the listed ids are the request's own.
    short = TraceEntry(0, 600, 4, [0])
    assert mooncake.prompt_token_ids(short, VOCAB, 0)[512:] != mooncake.prompt_token_ids(short, VOCAB, 1)[512:]


def test_trace_round_trip_and_bad_lines(tmp_path):
    path = tmp_path / "trace.jsonl"
    mooncake.write_trace(shared_prefix_trace(3), str(path))
    assert mooncake.read_trace(str(path)) == shared_prefix_trace(3)
    path.write_text('{"timestamp": 0, "input_length": 10}\n')
    with pytest.raises(ValueError, match="line 1"):
        mooncake.read_trace(str(path))
    path.write_text('{"timestamp": 0, "input_length": 0, "output_length": 3, "hash_ids": []}\n')
    with pytest.raises(ValueError, match="input_length"):
        mooncake.read_trace(str(path))


def test_requests_to_trace_keeps_the_sharing():
    requests = mooncake.trace_requests(shared_prefix_trace(4), VOCAB)
    again = mooncake.trace_requests(mooncake.trace_from_requests(requests), VOCAB)
    assert [e.hash_ids[:2] for e in mooncake.trace_from_requests(again)] == [[0, 1]] * 4
    assert [r.send_time for r in again] == pytest.approx([0.0, 0.01, 0.02, 0.03])


def test_prefix_hits_on_shared_ids(cost_model):
    requests = mooncake.trace_requests(shared_prefix_trace(8), VOCAB)
    on = simulate(requests, *configs(caching=True), cost_model)
    off = simulate(requests, *configs(caching=False), cost_model)
    prompt_len = len(requests[0].prompt_token_ids)
    # The first request computes the shared 1024 tokens; each later one finds them cached.
    assert on.summary()["prefix_cache_hit_rate"] == pytest.approx(7 * 1024 / (8 * prompt_len))
    assert not off.prefix_cache_hits
    assert on.summary()["ttft_ms"]["mean"] < off.summary()["ttft_ms"]["mean"]
    assert all(len(r.token_times) == 8 for r in on.requests)


def test_small_kv_cache_preempts_and_still_completes(cost_model):
    trace = [TraceEntry(0, 200, 200, [i]) for i in range(8)]
    requests = mooncake.trace_requests(trace, VOCAB)
    # 64 blocks of 16 = 1024 token slots for 8 requests that grow to 400 tokens each.
    tight = simulate(requests, *configs(num_blocks=64, lookahead=0), cost_model)
    roomy = simulate(requests, *configs(num_blocks=512, lookahead=0), cost_model)
    assert tight.num_preemptions > 0 and roomy.num_preemptions == 0
    assert tight.summary()["completed"] == 8
    assert tight.summary()["total_output_tokens"] == roomy.summary()["total_output_tokens"] == 1600
    assert tight.duration_s > roomy.duration_s  # preempted requests compute their tokens again


def test_same_keys_as_bench_serve_and_times_follow_the_cost_model(cost_model):
    requests = mooncake.trace_requests([TraceEntry(0, 100, 5, [0])], VOCAB)
    result = simulate(requests, *configs(budget=512), cost_model)
    summary = result.summary()
    assert set(summarize([RequestResult("all")], 1.0)) <= set(summary)
    assert {"prefix_cache_hit_rate", "num_preemptions"} <= set(summary)
    # One prompt step (100 tokens, 5050 pairs), then 4 decode steps (1 token after 100..103).
    prompt_ms = 5.0 + 50.0 * 0.1 + 10.0 * 5050 / 1e6
    assert summary["ttft_ms"]["mean"] == pytest.approx(prompt_ms)
    decode_ms = [5.0 + 50.0 / 1000 + 10.0 * (100 + i + 1) / 1e6 for i in range(4)]
    assert summary["e2el_ms"]["mean"] == pytest.approx(prompt_ms + sum(decode_ms))
    assert [s.num_prefill_tokens for s in result.steps] == [100, 0, 0, 0, 0]


def test_arrivals_wait_for_their_time(cost_model):
    trace = [TraceEntry(0, 64, 2, [0]), TraceEntry(5000, 64, 2, [1])]
    result = simulate(mooncake.trace_requests(trace, VOCAB), *configs(), cost_model)
    assert result.duration_s > 5.0
    assert result.requests[1].token_times[0] > 5.0
    # The second request found an idle engine: its TTFT is one prompt step, like the first's.
    ttfts = [r.result().ttft for r in result.requests]
    assert ttfts[0] == pytest.approx(ttfts[1])


def test_a_prompt_that_never_fits_is_a_clear_error(cost_model):
    requests = mooncake.trace_requests([TraceEntry(0, 600, 2, [0])], VOCAB)
    with pytest.raises(ValueError, match="KV cache"):
        simulate(requests, *configs(num_blocks=4), cost_model)


def test_bad_cost_file(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text('{"intercept_ms": -1, "ms_per_1k_tokens": 1, "ms_per_1m_attention_pairs": 1}')
    with pytest.raises(ValueError, match=">= 0"):
        read_cost_file(str(path))
    path.write_text("[]")
    with pytest.raises(ValueError, match="not a cost model"):
        read_cost_file(str(path))


def test_per_request_delays_shift_arrivals_and_tokens(tmp_path):
    """The cost model's per-request delays: a request reaches the scheduler arrival_delay
    after it is sent, and every token reaches the client output_delay after its step."""
    trace = [TraceEntry(0, 200, 4, []), TraceEntry(1000, 200, 4, [])]
    requests = mooncake.trace_requests(trace, VOCAB)
    plain = StepCostModel.from_dict(COST)
    delayed = StepCostModel.from_dict({**COST, "arrival_delay_ms": 30.0, "output_delay_ms": 7.0})
    before = simulate(requests, *configs(), plain)
    after = simulate(requests, *configs(), delayed)
    for a, b in zip(before.requests, after.requests, strict=True):
        assert [t + 0.037 for t in a.token_times] == pytest.approx(b.token_times)
        assert b.result().ttft == pytest.approx(a.result().ttft + 0.037)
    assert after.duration_s == pytest.approx(before.duration_s + 0.037)
