"""--target-step-ms through the engine on the tiny model: the same tokens as without it, and
every step within the budget its cost model computed, or full where the target would have
left a waiting request without a token.

The engine core's clock is replaced by a synthetic one (each step "takes" a fixed linear cost
of its shape), so nothing here depends on how fast this machine is.
"""

from __future__ import annotations

import random

import pytest
from transformers import AutoConfig

from tokenserve import LLM, SamplingParams
from tokenserve.core.engine_core import EngineCore
from tokenserve.core.scheduler import MIN_PREFILL_TOKENS
from tokenserve.core.step_cost import MIN_SAMPLES, WARMUP_STEPS, StepShape

from .test_step_cost import synthetic_seconds

# ms: 1 per step, 50 per 1e3 tokens, 20 per 1e6 attention pairs; the target leaves a step
# about 40 tokens, between the prefill minimum (16) and max_num_batched_tokens (64).
COST = (1.0, 50.0, 20.0)
TARGET_MS = 3.0
MAX_NUM_BATCHED_TOKENS = 64
PROMPT_LENGTHS = (3, 17, 40, 64, 90, 120, 150, 33, 9, 200)


class SyntheticClock:
    """Stands in for time.perf_counter: reading it after a step moves time on by that step's
    synthetic cost (the step's scheduler output is new then; before the step it is not)."""

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core
        self.now = 0.0
        self.last_output = None

    def __call__(self) -> float:
        output = self.engine_core.last_scheduler_output
        if output is not None and output is not self.last_output:
            self.last_output = output
            self.now += synthetic_seconds(StepShape.of(output), cost=COST)
        return self.now


@pytest.fixture(scope="module")
def prompts(tiny_model_dirs) -> list[list[int]]:
    vocab_size = AutoConfig.from_pretrained(tiny_model_dirs["llama"]).vocab_size
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def generate(model_dir: str, prompts: list[list[int]], **engine_args):
    """Greedy outputs, and for every engine step: (cost model ready?, the requests that were
    decode rows, the step's scheduler output, the scheduler stats after it, how many
    requests were waiting before it)."""
    llm = LLM(model_dir, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, **engine_args)
    engine_core = llm.llm_engine.engine_core
    engine_core.clock = SyntheticClock(engine_core)
    scheduler = engine_core.scheduler
    steps = []
    engine_step = engine_core.step

    def recorded_step():
        model = engine_core.step_cost_model
        ready = model is not None and model.is_ready
        decode_rows = {
            r.request_id for r in scheduler.running if r.num_tokens - r.num_computed_tokens == 1
        }
        waiting = len(scheduler.waiting)
        outputs = engine_step()
        output = engine_core.last_scheduler_output
        steps.append((ready, decode_rows, output, scheduler.make_stats(), waiting))
        return outputs

    engine_core.step = recorded_step  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], steps, engine_core


def test_target_step_time_keeps_outputs_and_sizes_every_step(tiny_model_dirs, prompts):
    model_dir = tiny_model_dirs["llama"]
    reference, reference_steps, _ = generate(model_dir, prompts)
    tokens, steps, engine_core = generate(model_dir, prompts, target_step_ms=TARGET_MS)
    assert tokens == reference  # greedy: chunking never changes a token

    model = engine_core.step_cost_model
    assert model is not None
    # The clock charges a decode token what it charges a prompt token.
    assert model.coefficients.tolist() == pytest.approx([*COST, COST[1]], rel=1e-3)  # learned the clock
    assert sum(1 for ready, *_ in steps if not ready) == WARMUP_STEPS + MIN_SAMPLES
    limited = lifted = 0
    sized_before = False
    for index, (ready, decode_rows, output, stats, waiting) in enumerate(steps):
        if not ready:
            assert stats.token_budget == MAX_NUM_BATCHED_TOKENS  # as without a target
            continue
        assert all(output.num_scheduled_tokens[rid] == 1 for rid in decode_rows)
        prefill = output.total_num_scheduled_tokens - len(decode_rows)
        assert output.total_num_scheduled_tokens <= MAX_NUM_BATCHED_TOKENS
        step_ms = synthetic_seconds(StepShape.of(output), cost=COST) * 1e3
        if index > WARMUP_STEPS + MIN_SAMPLES and sized_before:
            # Past its first prediction (from 4 look-alike full steps) and the first step
            # the target sized, which varies the shapes it has seen, the model knows the cost.
            assert stats.predicted_step_ms == pytest.approx(step_ms, rel=1e-3)
        sized_before = sized_before or stats.token_budget < MAX_NUM_BATCHED_TOKENS
        if prefill > MIN_PREFILL_TOKENS and stats.token_budget == MAX_NUM_BATCHED_TOKENS:
            # A full step: only when the target would have left a waiting request without
            # a token.
            assert waiting > 0
            lifted += 1
        elif prefill > MIN_PREFILL_TOKENS:
            # Beyond the minimum, prefill only fills what the target leaves.
            assert stats.predicted_step_ms <= TARGET_MS * (1 + 1e-9)
            assert step_ms <= TARGET_MS * (1 + 1e-3)
            limited += 1
    assert limited > 3  # the target did bind: prefill was sized by it, not by the 64 tokens
    assert lifted > 0  # and the ten prompts, all waiting at first, started in full steps
    assert len(steps) > len(reference_steps)
    stats = engine_core.make_stats()
    assert stats.kv_cache_usage == 0.0


def test_without_a_target_the_engine_keeps_no_cost_model(tiny_model_dirs, prompts):
    _, steps, engine_core = generate(tiny_model_dirs["llama"], prompts[:3])
    assert engine_core.step_cost_model is None
    assert engine_core.scheduler.step_cost_model is None
    assert all(stats.token_budget == MAX_NUM_BATCHED_TOKENS for _, _, _, stats, _ in steps)
    assert all(stats.predicted_step_ms is None for _, _, _, stats, _ in steps)
