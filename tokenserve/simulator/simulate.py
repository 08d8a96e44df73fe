"""`tokenserve simulate`: a trace through the real Scheduler and KVCacheManager, no model.

The engine core's loop on a virtual clock: requests arrive at their trace times, each
step is composed by the real `Scheduler` (token budget, chunked prefill, prefix cache,
admission lookahead, preemption) and lasts what the calibrated `StepCostModel` predicts
for its shape; every request that reaches its target gets one token. The figures are
`bench serve`'s (serve_metrics.summarize, the same keys) plus the prefix-cache hit rate
and the preemptions, from the scheduler's own counters.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any

from tokenserve.benchmarks.datasets import TOKEN_ID_MARGIN, BenchRequest
from tokenserve.benchmarks.openai_client import RequestResult
from tokenserve.benchmarks.serve_metrics import summarize
from tokenserve.config import CacheConfig, SchedulerConfig
from tokenserve.core.request import Request
from tokenserve.core.scheduler import Scheduler
from tokenserve.core.step_cost import StepCostModel, StepShape
from tokenserve.messages.model_runner_output import ModelRunnerOutput
from tokenserve.messages.scheduler_output import SchedulerOutput
from tokenserve.sampling_params import SamplingParams

# The token every simulated request "samples": an ordinary id, never EOS (EOS is ignored).
SIMULATED_TOKEN_ID = TOKEN_ID_MARGIN


@dataclass
class SimulatedRequest:
    """One request's virtual times (seconds since the trace's start)."""

    request: BenchRequest
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None

    def result(self) -> RequestResult:
        arrival = self.request.send_time
        chunk_times = [t - arrival for t in self.token_times]
        return RequestResult(
            group=self.request.group,
            send_time=arrival,
            success=self.finish_time is not None,
            ttft=chunk_times[0] if chunk_times else None,
            latency=(self.finish_time or arrival) - arrival,
            chunk_times=chunk_times,
            prompt_tokens=len(self.request.prompt_token_ids),
            output_tokens=len(self.token_times),
        )


@dataclass
class StepRecord:
    """What one simulated step computed, for the timeline."""

    start_s: float
    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int


@dataclass
class Simulation:
    """A finished simulation: per-request times, per-step records, scheduler counters."""

    requests: list[SimulatedRequest]
    steps: list[StepRecord]
    duration_s: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int

    def summary(self) -> dict[str, Any]:
        summary = summarize([r.result() for r in self.requests], self.duration_s)
        queries = self.prefix_cache_queries
        summary["prefix_cache_hit_rate"] = self.prefix_cache_hits / queries if queries else None
        summary["num_preemptions"] = float(self.num_preemptions)
        summary["num_steps"] = len(self.steps)
        return summary


def simulate(
    requests: list[BenchRequest],
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    cost_model: StepCostModel,
) -> Simulation:
    """Run `requests` (send times in seconds) to completion on a virtual clock."""
    if not cost_model.is_ready:
        raise ValueError("The step-cost model has no coefficients yet: calibrate it first.")
    # Under a target step time the scheduler sizes prefill with the same (fitted) model.
    scheduler = Scheduler(scheduler_config, cache_config, cost_model)
    # A request reaches the engine core a fixed delay after it is sent (HTTP, tokenizing),
    # and each of its tokens reaches the client a fixed delay after its step (detokenizing,
    # the SSE chunk): the cost model's per-request delays, measured by calibrate.
    to_engine = cost_model.arrival_delay_ms / 1e3
    to_client = cost_model.output_delay_ms / 1e3
    entry = [r.send_time + to_engine for r in requests]
    order = sorted(range(len(requests)), key=lambda i: entry[i])
    arrivals = collections.deque(order)
    states = [SimulatedRequest(r) for r in requests]
    by_id: dict[str, SimulatedRequest] = {}
    steps: list[StepRecord] = []
    clock = 0.0
    while arrivals or scheduler.has_unfinished_requests():
        while arrivals and entry[arrivals[0]] <= clock:
            index = arrivals.popleft()
            request_id = str(index)
            by_id[request_id] = states[index]
            scheduler.add_request(_engine_request(request_id, requests[index], scheduler_config))
        if not scheduler.has_unfinished_requests():
            clock = entry[arrivals[0]]
            continue
        num_running, num_waiting = len(scheduler.running), len(scheduler.waiting)
        output = scheduler.schedule()
        if output.is_empty:
            if not arrivals:
                raise ValueError(
                    "The simulated scheduler cannot place any waiting request: a prompt "
                    "does not fit the KV cache (raise --num-kv-blocks / --kv-cache-memory)."
                )
            clock = max(clock, entry[arrivals[0]])
            continue
        shape = StepShape.of(output)
        duration = max(cost_model.predict_ms(shape), 0.0) / 1e3
        sampled = [
            request_id
            for request_id in output.num_scheduled_tokens
            if scheduler.requests[request_id].num_computed_tokens
            >= scheduler.requests[request_id].num_tokens
        ]
        steps.append(_step_record(clock, duration, output, shape, num_running, num_waiting))
        clock += duration
        runner_output = ModelRunnerOutput(
            req_ids=sampled, sampled_token_ids=[[SIMULATED_TOKEN_ID] for _ in sampled]
        )
        for engine_output in scheduler.update_from_output(output, runner_output):
            state = by_id[engine_output.request_id]
            state.token_times += [clock + to_client] * len(engine_output.new_token_ids)
            if engine_output.finish_reason is not None:
                state.finish_time = clock + to_client
    stats = scheduler.kv_cache_manager.prefix_cache_stats
    return Simulation(
        requests=states,
        steps=steps,
        duration_s=clock + to_client if requests else clock,
        prefix_cache_queries=stats.queries,
        prefix_cache_hits=stats.hits,
        num_preemptions=scheduler.num_preemptions,
    )


def _engine_request(request_id: str, request: BenchRequest, config: SchedulerConfig) -> Request:
    prompt_len = len(request.prompt_token_ids)
    if prompt_len + 1 > config.max_model_len:
        raise ValueError(
            f"Request {request_id}: {prompt_len} prompt tokens leave no room under "
            f"max_model_len {config.max_model_len}."
        )
    max_tokens = min(request.output_len, config.max_model_len - prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, list(request.prompt_token_ids), params, eos_token_id=None,
                   arrival_time=request.send_time)


def _step_record(clock: float, duration: float, output: SchedulerOutput, shape: StepShape,
                 num_running: int, num_waiting: int) -> StepRecord:
    return StepRecord(clock, duration, shape.num_tokens - shape.num_decode_tokens,
                      shape.num_decode_tokens, num_running, num_waiting)


def realtime_ratio(simulation: Simulation, wall_seconds: float) -> float:
    """How many times faster than real time the simulation ran."""
    return simulation.duration_s / wall_seconds if wall_seconds > 0 else math.inf
