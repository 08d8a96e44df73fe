"""The step-cost model behind --target-step-ms: fitting, robustness, and the prefill allowance."""

from __future__ import annotations

import math
import random

import pytest

from tokenserve.core.step_cost import (
    LEVEL_SHIFT_STEPS,
    MIN_SAMPLES,
    WARMUP_STEPS,
    StepCostModel,
    StepShape,
    TargetStepBudget,
    attention_pairs,
)

# ms: a fixed cost, per 1e3 tokens, per 1e6 attention pairs.
TRUE_COST = (2.0, 5.0, 3.0)


def synthetic_seconds(shape: StepShape, cost=TRUE_COST, speed: float = 1.0) -> float:
    fixed, per_token, per_pair = cost
    step_ms = fixed + per_token * shape.num_tokens / 1e3 + per_pair * shape.attention_pairs / 1e6
    return speed * step_ms / 1e3


def random_shape(rng: random.Random) -> StepShape:
    """Some decode rows, and a prompt chunk half the time."""
    shape = StepShape()
    for _ in range(rng.randint(1, 16)):
        shape.add(rng.randint(0, 2000), 1)
    if rng.random() < 0.5:
        shape.add(rng.randint(0, 1000), rng.randint(1, 1024))
    return shape


def test_attention_pairs_count_causal_query_key_pairs():
    assert attention_pairs(0, 1) == 1
    assert attention_pairs(9, 1) == 10  # a decode row attends to its whole context
    assert attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attention_pairs(10, 3) == 11 + 12 + 13


def test_fits_a_linear_cost_exactly():
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(100):
        shape = random_shape(rng)
        model.record(shape, synthetic_seconds(shape))
    assert model.coefficients[:3].tolist() == pytest.approx(TRUE_COST, rel=1e-3)
    for _ in range(20):
        shape = random_shape(rng)
        assert model.predict_ms(shape) == pytest.approx(synthetic_seconds(shape) * 1e3, rel=1e-3)


def test_learns_a_cheaper_decode_row_apart():
    """Decode rows flagged as such get their own per-token cost (the simulator's case)."""
    rng = random.Random(7)
    model = StepCostModel()
    for _ in range(100):
        shape = StepShape()
        for _ in range(rng.randint(0, 32)):
            shape.add(rng.randint(0, 2000), 1, decode=True)
        if rng.random() < 0.5 or shape.num_tokens == 0:
            shape.add(rng.randint(0, 1000), rng.randint(1, 1024))
        prompt_tokens = shape.num_tokens - shape.num_decode_tokens
        step_ms = 2.0 + 5.0 * prompt_tokens / 1e3 + 3.0 * shape.attention_pairs / 1e6
        model.record(shape, (step_ms + 0.5 * shape.num_decode_tokens / 1e3) / 1e3)
    assert model.coefficients.tolist() == pytest.approx([2.0, 5.0, 3.0, 0.5], rel=1e-3)
    assert StepCostModel.from_dict(model.to_dict()).coefficients.tolist() == pytest.approx(
        model.coefficients.tolist())


def test_fit_at_once_ignores_outliers():
    """`fit` (what calibration uses): all samples at once, outliers trimmed."""
    rng = random.Random(8)
    samples = []
    for index in range(200):
        shape = StepShape()
        for _ in range(rng.randint(0, 32)):
            shape.add(rng.randint(0, 2000), 1, decode=True)
        if rng.random() < 0.5 or shape.num_tokens == 0:
            shape.add(rng.randint(0, 1000), rng.randint(1, 1024))
        seconds = synthetic_seconds(shape) * rng.uniform(0.98, 1.02)
        samples.append((shape, seconds * (20 if index % 25 == 0 else 1)))  # a pause now and then
    model = StepCostModel.fit(samples)
    # Decode rows cost what prompt tokens do on this synthetic clock.
    assert model.coefficients.tolist() == pytest.approx([*TRUE_COST, TRUE_COST[1]], rel=0.05)
    assert model.is_ready and model.num_samples < len(samples)


def test_noise_and_outliers_barely_move_the_fit():
    rng = random.Random(1)
    model = StepCostModel()
    for _ in range(400):
        shape = random_shape(rng)
        seconds = synthetic_seconds(shape) * rng.uniform(0.9, 1.1)
        if rng.random() < 0.05:
            seconds *= 20  # a pause: GC, another process
        model.record(shape, seconds)
    assert model.num_outliers > 0
    for _ in range(50):
        shape = random_shape(rng)
        assert model.predict_ms(shape) == pytest.approx(synthetic_seconds(shape) * 1e3, rel=0.15)


def test_warm_up_steps_are_ignored_and_nothing_is_predicted_before_enough_samples():
    rng = random.Random(2)
    model = StepCostModel()
    for _ in range(WARMUP_STEPS):
        model.record(random_shape(rng), 100.0)  # absurdly slow first steps
    assert model.num_samples == 0
    model.record(StepShape(), 1.0)  # an empty step teaches nothing
    model.record(random_shape(rng), math.nan)
    model.record(random_shape(rng), -1.0)
    assert model.num_samples == 0 and model.num_steps_seen == WARMUP_STEPS
    for _ in range(MIN_SAMPLES):
        assert not model.is_ready
        shape = random_shape(rng)
        model.record(shape, synthetic_seconds(shape))
    assert model.is_ready
    for _ in range(50):
        shape = random_shape(rng)
        model.record(shape, synthetic_seconds(shape))
    # The warm-up steps left no trace.
    assert model.coefficients[:3].tolist() == pytest.approx(TRUE_COST, rel=1e-3)


@pytest.mark.parametrize("speed", [3.0, 0.3])
def test_a_lasting_change_of_speed_is_learned_within_a_few_steps(speed):
    rng = random.Random(3)
    model = StepCostModel()
    for _ in range(100):
        shape = random_shape(rng)
        model.record(shape, synthetic_seconds(shape))
    for _ in range(LEVEL_SHIFT_STEPS + 2):  # the machine got slower (or faster), for good
        shape = random_shape(rng)
        model.record(shape, synthetic_seconds(shape, speed=speed))
    assert model.num_level_shifts == 1
    for _ in range(20):
        shape = random_shape(rng)
        assert model.predict_ms(shape) == pytest.approx(
            synthetic_seconds(shape, speed=speed) * 1e3, rel=0.05
        )


def test_a_change_in_one_cost_is_learned_too():
    rng = random.Random(6)
    model = StepCostModel()
    for _ in range(100):
        shape = random_shape(rng)
        model.record(shape, synthetic_seconds(shape))
    slower_attention = (2.0, 5.0, 9.0)
    for _ in range(100):
        shape = random_shape(rng)
        model.record(shape, synthetic_seconds(shape, cost=slower_attention))
    assert model.coefficients[:3].tolist() == pytest.approx(slower_attention, rel=0.05)


def test_a_few_spikes_in_a_row_are_not_a_change_of_speed():
    rng = random.Random(7)
    model = StepCostModel()
    for _ in range(50):
        shape = random_shape(rng)
        model.record(shape, synthetic_seconds(shape))
    before = model.coefficients.copy()
    for _ in range(LEVEL_SHIFT_STEPS - 1):
        shape = random_shape(rng)
        model.record(shape, synthetic_seconds(shape) * 50)
    assert model.num_level_shifts == 0
    assert model.coefficients.tolist() == pytest.approx(before.tolist(), rel=0.1)


@pytest.mark.parametrize("seed", range(5))
def test_coefficients_and_allowances_are_never_negative(seed):
    """Adversarial data (bigger steps faster, random times) never gives a negative coefficient,
    a negative allowance, or a grant outside [minimum, wanted]."""
    rng = random.Random(seed)
    model = StepCostModel(warmup_steps=0, min_samples=1)
    for _ in range(60):
        shape = random_shape(rng)
        seconds = rng.uniform(0.0, 0.05) if seed % 2 else 0.05 / (1 + shape.num_tokens)
        model.record(shape, seconds)
        assert all(coefficient >= 0 for coefficient in model.coefficients)
        assert all(math.isfinite(coefficient) for coefficient in model.coefficients)
        for target_ms in (0.001, 1.0, 30.0, 1e6):
            assert model.max_new_tokens(random_shape(rng), rng.randint(0, 4000), target_ms) >= 0
            budget = TargetStepBudget(model, target_ms, random_shape(rng), 16, 512)
            assert 16 <= budget.token_budget
            wanted = rng.randint(1, 2048)
            assert min(16, wanted) <= budget.grant(rng.randint(0, 1000), wanted) <= wanted


def test_max_new_tokens_is_the_largest_count_within_the_target():
    rng = random.Random(4)
    model = StepCostModel()
    for _ in range(50):
        shape = random_shape(rng)
        model.record(shape, synthetic_seconds(shape))
    decodes = StepShape()
    for _ in range(8):
        decodes.add(500, 1)

    def predicted(num_computed: int, num_new: int) -> float:
        shape = StepShape(decodes.num_tokens, decodes.attention_pairs)
        shape.add(num_computed, num_new)
        return model.predict_ms(shape)

    for num_computed, target_ms in ((0, 10.0), (700, 10.0), (3000, 25.0)):
        count = math.floor(model.max_new_tokens(decodes, num_computed, target_ms))
        assert count > 0
        assert predicted(num_computed, count) <= target_ms < predicted(num_computed, count + 1)
    # Decodes alone over the target leave nothing.
    assert model.max_new_tokens(decodes, 0, model.predict_ms(decodes) / 2) == 0


def test_target_budget_grants_the_minimum_then_what_fits():
    model = StepCostModel(warmup_steps=0, min_samples=1)
    rng = random.Random(5)
    for _ in range(30):
        shape = random_shape(rng)
        model.record(shape, synthetic_seconds(shape))
    decodes = StepShape()
    decodes.add(100, 1)
    slow = TargetStepBudget(model, 0.5, decodes, 16, 2048)  # under the fixed cost alone
    assert slow.token_budget == 1 + 16
    assert slow.grant(0, 500) == 16  # the minimum: prefill always advances
    assert slow.grant(0, 500) == 0
    roomy = TargetStepBudget(model, 12.0, decodes, 16, 2048)
    first = roomy.grant(0, 4000)
    assert 16 < first < 4000
    assert model.predict_ms(roomy.shape) <= 12.0
    assert roomy.grant(0, 4000) <= 1  # the first chunk used the room (up to rounding)
    assert model.predict_ms(roomy.shape) <= 12.0
    whole = TargetStepBudget(model, 0.5, decodes, 16, 2048, chunked=False)
    assert whole.grant(0, 300) == 300  # without chunking the step's first prompt goes whole
    assert whole.grant(0, 20) == 0
