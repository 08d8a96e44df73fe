"""The step-cost model behind --target-step-ms: fitting, robustness, and the prefill allowance."""

from __future__ import annotations

import math
import random

import pytest

from tokenserve.core.step_cost import (
    LEVEL_SHIFT_STEPS,
    MIN_SAMPLES,
    WARMUP_STEPS,
    KernelRegimeCostModel,
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


def rows_and_chunk(rng: random.Random) -> StepShape:
    """A step of up to 32 decode rows and, half the time (always without rows), a prompt
    chunk."""
    shape = StepShape()
    for _ in range(rng.randint(0, 32)):
        shape.add(rng.randint(0, 2000), 1, decode=True)
    if rng.random() < 0.5 or shape.num_tokens == 0:
        shape.add(rng.randint(0, 1000), rng.randint(1, 1024))
    return shape


def test_learns_a_cheaper_decode_row_apart():
    """Decode rows flagged as such get their own per-token cost (the simulator's case)."""
    rng = random.Random(7)
    model = StepCostModel()
    for _ in range(100):
        shape = rows_and_chunk(rng)
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
        shape = rows_and_chunk(rng)
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


# ms, per kernel regime (few-row ≤ 10 rows, panel ≤ 192, oneDNN): intercept, per 1e3 rows
# on top of the shared terms (none for oneDNN); shared: per 1e3 prompt tokens, per 1e6
# pairs, per 1e3 decode tokens.
REGIME_COST = {"intercepts": (4.0, 8.0, 30.0), "per_row": (1800.0, 500.0, 0.0),
               "shared": (650.0, 300.0, 1700.0)}


def regime_ms(shape: StepShape) -> float:
    regime = 0 if shape.num_tokens <= 10 else 1 if shape.num_tokens <= 192 else 2
    per_prompt, per_pair, per_decode = REGIME_COST["shared"]
    return (REGIME_COST["intercepts"][regime]
            + REGIME_COST["per_row"][regime] * shape.num_tokens / 1e3
            + per_prompt * (shape.num_tokens - shape.num_decode_tokens) / 1e3
            + per_pair * shape.attention_pairs / 1e6 + per_decode * shape.num_decode_tokens / 1e3)


def regime_shapes(rng: random.Random, count: int) -> list[StepShape]:
    """Decode batches of 1-64 rows, prompt chunks of 16-1024 tokens, and mixes of both."""
    shapes = []
    for _ in range(count):
        shape = StepShape()
        kind = rng.random()
        if kind < 0.7:
            for _ in range(rng.choice([1, 2, 4, 8, 16, 32, 64])):
                shape.add(rng.randint(16, 2000), 1, decode=True)
        if kind > 0.4 or shape.num_tokens == 0:
            shape.add(rng.randint(0, 1000), rng.choice([16, 64, 128, 256, 512, 1024]))
        shapes.append(shape)
    return shapes


def test_kernel_regimes_are_fitted_apart():
    """What calibrate fits: each kernel regime's own intercept and per-row cost, where one
    line through every step would miss both a lone decode row and a 128-token chunk."""
    rng = random.Random(11)
    samples = [(shape, regime_ms(shape) / 1e3) for shape in regime_shapes(rng, 300)]
    model = KernelRegimeCostModel.fit(samples, few_rows=10, panel_rows=192)
    expected = [*REGIME_COST["intercepts"], *REGIME_COST["shared"], *REGIME_COST["per_row"][:2]]
    assert model.coefficients.tolist() == pytest.approx(expected, rel=1e-3)
    linear = StepCostModel.fit(samples)
    lone_row, chunk = StepShape(1, 500, 1), StepShape(128, attention_pairs(0, 128))
    for shape in (lone_row, chunk):
        assert model.predict_ms(shape) == pytest.approx(regime_ms(shape), rel=1e-3)
        assert abs(linear.predict_ms(shape) / regime_ms(shape) - 1) > 0.1


def test_a_regime_model_round_trips_through_its_dict_and_an_old_dict_still_loads():
    rng = random.Random(12)
    samples = [(shape, regime_ms(shape) / 1e3) for shape in regime_shapes(rng, 200)]
    model = KernelRegimeCostModel.fit(samples, few_rows=6, panel_rows=100)
    model.arrival_delay_ms, model.output_delay_ms = 12.0, 3.0
    data = model.to_dict()
    # The oneDNN regime under the four-term keys, for a reader that knows only those.
    assert data["intercept_ms"] == pytest.approx(model.coefficients[2])
    loaded = StepCostModel.from_dict(data)
    assert isinstance(loaded, KernelRegimeCostModel)
    assert (loaded.few_rows, loaded.panel_rows) == (6, 100)
    assert loaded.coefficients.tolist() == pytest.approx(model.coefficients.tolist())
    assert (loaded.arrival_delay_ms, loaded.output_delay_ms) == (12.0, 3.0)
    old = StepCostModel.from_dict({"intercept_ms": 1.0, "ms_per_1k_tokens": 2.0,
                                   "ms_per_1m_attention_pairs": 3.0})
    assert type(old) is StepCostModel
    assert old.coefficients.tolist() == [1.0, 2.0, 3.0, 2.0]
    assert (old.arrival_delay_ms, old.output_delay_ms) == (0.0, 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        StepCostModel.from_dict({**data, "output_delay_ms": -1.0})


@pytest.mark.parametrize("target_ms", [5.0, 20.0, 60.0, 150.0, 400.0, 2000.0])
def test_a_regime_models_allowance_keeps_the_step_under_target(target_ms):
    """max_new_tokens regime by regime: the allowance fits, and one token more does not
    (unless it reaches a cheaper regime's end, where the next regime costs more)."""
    rng = random.Random(13)
    samples = [(shape, regime_ms(shape) / 1e3) for shape in regime_shapes(rng, 300)]
    model = KernelRegimeCostModel.fit(samples, few_rows=10, panel_rows=192)
    for decode_rows in (0, 1, 4, 16):
        shape = StepShape()
        for _ in range(decode_rows):
            shape.add(300, 1, decode=True)
        allowance = model.max_new_tokens(shape, 0, target_ms)
        assert allowance >= 0
        if allowance == 0:
            continue
        n = int(allowance)
        grown = StepShape(shape.num_tokens, shape.attention_pairs, shape.num_decode_tokens)
        grown.add(0, n)
        assert model.predict_ms(grown) <= target_ms * (1 + 1e-9)
        beyond = StepShape(shape.num_tokens, shape.attention_pairs, shape.num_decode_tokens)
        beyond.add(0, n + 1)
        assert model.predict_ms(beyond) > target_ms or shape.num_tokens + n in (10, 192)


def test_a_fit_drops_at_most_a_quarter_of_its_samples():
    """Where half the steps fit the model exactly and half are noisy, the trimming against
    the median residual would drop most of the noisy half (21 of 41 kept): the fit keeps
    three quarters, dropping the farthest first."""
    rng = random.Random(13)
    samples = []
    for index in range(40):
        shape = rows_and_chunk(rng)
        noise = 1.0 if index % 2 else rng.uniform(0.8, 1.2)
        samples.append((shape, synthetic_seconds(shape) * noise))
    samples.append((samples[0][0], synthetic_seconds(samples[0][0]) * 50))  # a pause
    model = StepCostModel.fit(samples)
    assert model.num_samples == 31  # ceil(41 * 0.75), the pause among those dropped:
    paused = samples[0][0]
    assert model.predict_ms(paused) == pytest.approx(synthetic_seconds(paused) * 1e3, rel=0.2)
