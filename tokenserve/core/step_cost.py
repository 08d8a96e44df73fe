"""What a step costs, learned as the engine runs, and the prefill it leaves room for.

Behind `--target-step-ms`, and the simulator's step time (simulator/). A step's shape is
the tokens it computes, split into prompt tokens and decode rows' tokens, and the
query-key pairs its attention covers; its wall time is modelled as

    step_ms ≈ a + b · prompt_tokens / 1e3 + c · pairs / 1e6 + d · decode_tokens / 1e3
                                                              (a, b, c, d ≥ 0)

(a decode row reads every weight for one token: on a CPU it costs far less than a
prompt token computed in a large product.)

fitted by exponentially weighted least squares over the steps the engine core records.
A lone outlying step (a GC pause) is down-weighted or ignored; a run of them on one side
is the machine getting slower or faster, and the fit is rescaled to it. The first steps
are skipped as warm-up, and until a few samples are in the model says nothing, so the
scheduler behaves as it does without a target. `TargetStepBudget` turns the fit into one
step's prefill allowance: decode rows always get their token, prefill chunks fill what
the predicted time leaves under the target, but at least a minimum so prefill never
stops.

`KernelRegimeCostModel`, what `tokenserve calibrate` fits for the simulator, prices each
kernel regime of a step (GGUF few-row kernel, panel kernel, oneDNN: by the step's rows) with
its own intercept and per-row cost; a model also carries the per-request delays outside the
steps (to the engine, back to the client) that the simulator adds.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import numpy as np

if TYPE_CHECKING:
    from tokenserve.messages.scheduler_output import SchedulerOutput

# Intercept, prompt tokens, attention pairs, decode tokens.
NUM_FEATURES = 4
# KernelRegimeCostModel's: three regime intercepts, the other three, two per-row extras.
NUM_REGIME_FEATURES = 8
# Feature scales: they keep the fitted coefficients of comparable size.
TOKEN_SCALE = 1e3
PAIR_SCALE = 1e6
# Non-empty steps not recorded at start (allocator, kernels and caches warming up).
WARMUP_STEPS = 3
# Samples after warm-up before the model predicts anything.
MIN_SAMPLES = 4
# Weight of a sample n steps old: FORGETTING ** n (a memory of about 20 steps).
FORGETTING = 0.95
# A residual beyond OUTLIER_K typical residuals counts as only OUTLIER_K of them.
OUTLIER_K = 3.0
# ... and one beyond REJECT_K of them, alone, not at all.
REJECT_K = 10.0
# This many outliers in a row on one side are a change of cost, learned at full weight.
LEVEL_SHIFT_STEPS = 3
# ... after which the earlier steps are rescaled to the new level (by at most this factor
# either way) and weigh this much.
MAX_LEVEL_SHIFT = 10.0
LEVEL_SHIFT_DISCOUNT = 0.5
# Typical residual never below this fraction of the prediction, nor below MIN_SCALE_MS.
MIN_RELATIVE_SCALE = 0.05
MIN_SCALE_MS = 0.01
# The share of its samples a fit at once (`StepCostModel.fit`) may drop as outliers at most.
MAX_TRIMMED = 0.25
# Keeps the normal equations solvable when the steps seen so far all look alike
# (relative to each feature's own weight, so small features are not biased).
RIDGE = 1e-6


def attention_pairs(num_computed_tokens: int, num_new_tokens: int) -> int:
    """Query-key pairs causal attention covers for `num_new_tokens` after `num_computed_tokens`."""
    return num_new_tokens * num_computed_tokens + num_new_tokens * (num_new_tokens + 1) // 2


@dataclass
class StepShape:
    """What a step computes, as far as its cost goes."""

    num_tokens: int = 0
    attention_pairs: int = 0
    # Of num_tokens, those of decode rows (a running request's next token and its drafts).
    num_decode_tokens: int = 0

    def add(self, num_computed_tokens: int, num_new_tokens: int, decode: bool = False) -> None:
        """Add one request's row: `num_new_tokens` computed after `num_computed_tokens`."""
        self.num_tokens += num_new_tokens
        self.attention_pairs += attention_pairs(num_computed_tokens, num_new_tokens)
        if decode:
            self.num_decode_tokens += num_new_tokens

    @classmethod
    def of(cls, scheduler_output: SchedulerOutput) -> StepShape:
        shape = cls()
        # num_computed_tokens in a SchedulerOutput is the count before the step.
        num_computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            num_computed[new.request_id] = new.num_computed_tokens
        for cached in scheduler_output.scheduled_cached_reqs:
            num_computed[cached.request_id] = cached.num_computed_tokens
        new_ids = {new.request_id for new in scheduler_output.scheduled_new_reqs}
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for request_id, num_new in scheduler_output.num_scheduled_tokens.items():
            # A decode row: a running request's one token (with its drafts, if any).
            decode = request_id not in new_ids and (num_new == 1 or request_id in drafts)
            shape.add(num_computed[request_id], num_new, decode)
        return shape

    def features(self) -> np.ndarray:
        return np.array([
            1.0,
            (self.num_tokens - self.num_decode_tokens) / TOKEN_SCALE,
            self.attention_pairs / PAIR_SCALE,
            self.num_decode_tokens / TOKEN_SCALE,
        ])


class StepCostModel:
    """step_ms ≈ a + b·prompt tokens + c·pairs + d·decode tokens, fitted online from recorded steps."""

    def __init__(
        self,
        warmup_steps: int = WARMUP_STEPS,
        min_samples: int = MIN_SAMPLES,
        forgetting: float = FORGETTING,
    ) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}.")
        self.warmup_steps = warmup_steps
        self.min_samples = max(min_samples, 1)
        self.forgetting = forgetting
        self.num_steps_seen = 0
        self.num_samples = 0
        self.num_outliers = 0
        # Weighted normal equations: sum w·x·xᵀ and sum w·x·y (y in ms).
        self._gram = np.zeros((NUM_FEATURES, NUM_FEATURES))
        self._moment = np.zeros(NUM_FEATURES)
        # ms: intercept, per TOKEN_SCALE prompt tokens, per PAIR_SCALE attention pairs,
        # per TOKEN_SCALE decode tokens.
        self.coefficients = np.zeros(NUM_FEATURES)
        self._residual_scale_ms: float | None = None
        # Consecutive outliers, signed: > 0 slower than predicted, < 0 faster.
        self._outlier_streak = 0
        self.num_level_shifts = 0
        # Per request, outside the steps (the simulator's; calibrate measures them): from
        # being sent to reaching the engine core (HTTP, tokenizing), and from a step's end
        # to its token reaching the client (detokenizing, the SSE chunk).
        self.arrival_delay_ms = 0.0
        self.output_delay_ms = 0.0

    @property
    def is_ready(self) -> bool:
        return self.num_samples >= self.min_samples

    def to_dict(self) -> dict[str, float | int]:
        """The fit, as `tokenserve calibrate` writes it (cost.json)."""
        intercept, per_token, per_pair, per_decode = (float(c) for c in self.coefficients)
        return {"intercept_ms": intercept, "ms_per_1k_tokens": per_token,
                "ms_per_1m_attention_pairs": per_pair, "ms_per_1k_decode_tokens": per_decode,
                **self._delays(), "num_samples": self.num_samples}

    def _delays(self) -> dict[str, float]:
        return {"arrival_delay_ms": self.arrival_delay_ms, "output_delay_ms": self.output_delay_ms}

    @classmethod
    def from_dict(cls, data: dict[str, float | int]) -> StepCostModel:
        """A model fitted elsewhere (`to_dict`'s form): ready, and it learns on from there."""
        try:
            coefficients = [float(data[name]) for name in
                            ("intercept_ms", "ms_per_1k_tokens", "ms_per_1m_attention_pairs")]
            # Without a decode term, a decode token costs what a prompt token does.
            coefficients.append(float(data.get("ms_per_1k_decode_tokens", coefficients[1])))
            delays = [float(data.get(name, 0.0)) for name in ("arrival_delay_ms", "output_delay_ms")]
            if "kernel_regimes" in data:
                model: StepCostModel = KernelRegimeCostModel._from_regimes(data, coefficients)
            else:
                model = cls(warmup_steps=0)._set(coefficients)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
            raise ValueError(f"Not a step-cost model: {error!r}.") from None
        if not all(math.isfinite(d) and d >= 0 for d in delays):
            raise ValueError(f"Per-request delays must be finite and >= 0, got {delays}.")
        model.arrival_delay_ms, model.output_delay_ms = delays
        return model

    def _set(self, coefficients: list[float]) -> Self:
        if not all(math.isfinite(c) and c >= 0 for c in coefficients):
            raise ValueError(f"Step-cost coefficients must be finite and >= 0, got {coefficients}.")
        self.coefficients = np.array(coefficients)
        self.num_samples = self.min_samples
        return self

    @property
    def num_features(self) -> int:
        return len(self.coefficients)

    def features(self, shape: StepShape) -> np.ndarray:
        """The step's terms in this model's fit (the four of `StepShape.features`)."""
        return shape.features()

    def predict_ms(self, shape: StepShape) -> float:
        return float(self.coefficients @ self.features(shape))

    def record(self, shape: StepShape, seconds: float) -> None:
        """Learn from one executed step of `shape` that took `seconds` of wall time."""
        if shape.num_tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        self.num_steps_seen += 1
        if self.num_steps_seen <= self.warmup_steps:
            return
        features = self.features(shape)
        step_ms = seconds * 1e3
        weight = self._weigh(step_ms, float(self.coefficients @ features)) if self.is_ready else 1.0
        if weight == 0.0:
            return
        self._gram = self.forgetting * self._gram + weight * np.outer(features, features)
        self._moment = self.forgetting * self._moment + weight * step_ms * features
        self.num_samples += 1
        self.coefficients = self._solve()

    @classmethod
    def fit(cls, samples: list[tuple[StepShape, float]], trim: float = OUTLIER_K,
            **kwargs: Any) -> Self:
        """A model fitted at once to (shape, seconds) samples: non-negative least squares,
        then again without the samples beyond `trim` times the median residual (a
        calibration's noise: GC pauses, a neighbour's burst), but never without more than
        MAX_TRIMMED of them (where the steps that fit best fit exactly, a few regimes' terms
        for a few steps, their median is no measure of the others' noise; those with the
        largest residuals go first). No forgetting, no level shifts: those are for learning
        online."""
        model = cls(warmup_steps=0, forgetting=1.0, **kwargs)
        kept = [(shape, seconds * 1e3) for shape, seconds in samples
                if shape.num_tokens > 0 and math.isfinite(seconds) and seconds >= 0]
        least = math.ceil(len(kept) * (1 - MAX_TRIMMED))
        for _ in range(2):
            features = np.array([model.features(shape) for shape, _ in kept]).reshape(
                -1, model.num_features)
            times = np.array([step_ms for _, step_ms in kept])
            model._gram = features.T @ features
            model._moment = features.T @ times
            model.coefficients = model._solve()
            residuals = np.abs(features @ model.coefficients - times)
            limit = trim * max(float(np.median(residuals)) if len(kept) else 0.0, MIN_SCALE_MS)
            count = max(int((residuals <= limit).sum()), least)
            best = np.sort(np.argsort(residuals, kind="stable")[:count])
            kept = [kept[index] for index in best]
        model.num_samples = len(kept)
        return model

    def _weigh(self, step_ms: float, predicted: float) -> float:
        """A step's weight in the fit: 1, less for an outlier, 0 for an isolated far one.

        A run of outliers on one side is no accident but a new cost level (contention,
        clocks): what was learned is rescaled to it and weighs less from then on.
        """
        residual = abs(step_ms - predicted)
        scale = max(
            self._residual_scale_ms if self._residual_scale_ms is not None else residual,
            MIN_RELATIVE_SCALE * predicted,
            MIN_SCALE_MS,
        )
        # The typical residual follows the clipped ones, so it can grow after a real change.
        self._residual_scale_ms = 0.9 * scale + 0.1 * min(residual, OUTLIER_K * scale)
        if residual <= OUTLIER_K * scale:
            self._outlier_streak = 0
            return 1.0
        side = 1 if step_ms > predicted else -1
        same_side = self._outlier_streak * side > 0
        self._outlier_streak = self._outlier_streak + side if same_side else side
        if abs(self._outlier_streak) == LEVEL_SHIFT_STEPS and predicted > 0:
            ratio = min(max(step_ms / predicted, 1 / MAX_LEVEL_SHIFT), MAX_LEVEL_SHIFT)
            self._gram *= LEVEL_SHIFT_DISCOUNT
            self._moment *= LEVEL_SHIFT_DISCOUNT * ratio
            self.num_level_shifts += 1
        if abs(self._outlier_streak) >= LEVEL_SHIFT_STEPS:
            return 1.0
        self.num_outliers += 1
        if residual > REJECT_K * scale:
            return 0.0
        return OUTLIER_K * scale / residual

    def _solve(self) -> np.ndarray:
        """Least squares with every coefficient ≥ 0: the best over the supports (15 for 4
        unknowns)."""
        num_features = len(self._moment)
        gram = self._gram + np.diag(RIDGE * np.diag(self._gram) + 1e-12)
        try:
            solution = np.linalg.solve(gram, self._moment)
            if np.all(np.isfinite(solution)) and np.all(solution >= 0):
                return solution  # the unconstrained best is feasible: the usual case
        except np.linalg.LinAlgError:
            pass
        best, best_loss = np.zeros(num_features), 0.0  # the empty support: loss 0 relative to the constant
        for size in range(1, num_features + 1):
            for support in itertools.combinations(range(num_features), size):
                index = list(support)
                try:
                    solution = np.linalg.solve(gram[np.ix_(index, index)], self._moment[index])
                except np.linalg.LinAlgError:
                    continue
                if not np.all(np.isfinite(solution)) or np.any(solution < 0):
                    continue
                candidate = np.zeros(num_features)
                candidate[index] = solution
                loss = float(candidate @ gram @ candidate - 2 * candidate @ self._moment)
                if loss < best_loss:
                    best, best_loss = candidate, loss
        return best

    def max_new_tokens(self, shape: StepShape, num_computed_tokens: int, target_ms: float) -> float:
        """The most tokens one request (`num_computed_tokens` done) can add to `shape` and
        keep the predicted step time within `target_ms` (may be inf, never negative)."""
        slack = target_ms - self.predict_ms(shape)
        if slack <= 0:
            return 0.0
        if math.isinf(slack):
            return math.inf
        _, per_token, per_pair, _ = self.coefficients
        # Adding n tokens adds q·n² + l·n milliseconds (attention_pairs, expanded).
        quadratic = per_pair / PAIR_SCALE / 2
        linear = per_token / TOKEN_SCALE + per_pair / PAIR_SCALE * (num_computed_tokens + 0.5)
        denominator = linear + math.sqrt(linear * linear + 4 * quadratic * slack)
        if denominator <= 0:
            return math.inf
        return 2 * slack / denominator  # the positive root, in a form stable as q → 0


class KernelRegimeCostModel(StepCostModel):
    """The four-term model per kernel regime: what `tokenserve calibrate` fits for the simulator.

    A step's products take the GGUF few-row kernel up to `few_rows` rows (the step's
    tokens), the panel kernel up to `panel_rows`, oneDNN above (KernelConfig's
    quantized_max_rows and quantized_gemm_max_rows; a decode-only step of those sizes, and
    a bf16 model's steps whose prompt chunks attend on the prompt kernel, also run fused,
    layer by layer in C). Each kernel has its own fixed cost and its own
    cost per row, so one line through all steps over-prices a lone decode row and
    under-prices a 100-row step. Here the step's regime picks its intercept, and the two
    smaller regimes add a cost per row on top of the oneDNN-regime terms:

        step_ms ≈ a_r + e_r · tokens / 1e3 + b · prompt_tokens / 1e3 + c · pairs / 1e6
                  + d · decode_tokens / 1e3                 (r: the step's regime; e_large = 0)

    Fitted at once (`fit`, all coefficients ≥ 0); `to_dict` writes the oneDNN regime under
    the four-term keys (what an older reader uses) and the two others under
    "kernel_regimes".
    """

    def __init__(self, *args: Any, few_rows: int = 10, panel_rows: int = 192, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if few_rows < 0 or panel_rows < 0:
            raise ValueError(f"Kernel row limits must be >= 0, got {few_rows}, {panel_rows}.")
        self.few_rows = few_rows
        self.panel_rows = max(panel_rows, few_rows)
        self._gram = np.zeros((NUM_REGIME_FEATURES, NUM_REGIME_FEATURES))
        self._moment = np.zeros(NUM_REGIME_FEATURES)
        self.coefficients = np.zeros(NUM_REGIME_FEATURES)

    def regime(self, num_tokens: int) -> int:
        """0: few-row kernel, 1: panel kernel, 2: oneDNN."""
        if num_tokens <= self.few_rows:
            return 0
        return 1 if num_tokens <= self.panel_rows else 2

    def features(self, shape: StepShape) -> np.ndarray:
        # Regime intercepts (few, panel, oneDNN), the shared terms, per-row extras (few, panel).
        base = shape.features()
        regime = self.regime(shape.num_tokens)
        features = np.zeros(NUM_REGIME_FEATURES)
        features[regime] = 1.0
        features[3:6] = base[1:4]
        if regime < 2:
            features[6 + regime] = shape.num_tokens / TOKEN_SCALE
        return features

    def to_dict(self) -> dict[str, Any]:
        few, panel, large, per_token, per_pair, per_decode, few_row, panel_row = (
            float(c) for c in self.coefficients)
        return {"intercept_ms": large, "ms_per_1k_tokens": per_token,
                "ms_per_1m_attention_pairs": per_pair, "ms_per_1k_decode_tokens": per_decode,
                "kernel_regimes": [
                    {"max_rows": self.few_rows, "intercept_ms": few, "ms_per_1k_rows": few_row},
                    {"max_rows": self.panel_rows, "intercept_ms": panel, "ms_per_1k_rows": panel_row},
                ],
                **self._delays(), "num_samples": self.num_samples}

    @classmethod
    def _from_regimes(cls, data: dict[str, Any], base: list[float]) -> KernelRegimeCostModel:
        few, panel = data["kernel_regimes"]
        model = cls(warmup_steps=0, few_rows=int(few["max_rows"]), panel_rows=int(panel["max_rows"]))
        return model._set([float(few["intercept_ms"]), float(panel["intercept_ms"]), base[0],
                           *base[1:], float(few["ms_per_1k_rows"]), float(panel["ms_per_1k_rows"])])

    def max_new_tokens(self, shape: StepShape, num_computed_tokens: int, target_ms: float) -> float:
        """As the four-term model's, regime by regime: the most tokens that keep the step
        within `target_ms` in the regime the step then falls in."""
        if target_ms - self.predict_ms(shape) <= 0:
            return 0.0
        best = 0.0
        bounds = ((0, self.few_rows), (self.few_rows, self.panel_rows), (self.panel_rows, math.inf))
        for regime, (low, high) in enumerate(bounds):
            if high <= shape.num_tokens or high <= low:
                continue  # a step already past this regime, or an empty one
            # The step's own terms, priced in this regime, then n more prompt tokens.
            intercept = self.coefficients[regime]
            per_token = self.coefficients[3] + (self.coefficients[6 + regime] if regime < 2 else 0.0)
            own = (intercept + per_token * shape.num_tokens / TOKEN_SCALE
                   + self.coefficients[4] * shape.attention_pairs / PAIR_SCALE
                   + (self.coefficients[5] - self.coefficients[3])
                   * shape.num_decode_tokens / TOKEN_SCALE)
            slack = target_ms - own
            if slack <= 0:
                continue
            fits = _root(per_token, self.coefficients[4], num_computed_tokens, slack)
            # n (whole tokens) must put the step in this regime: more than low - tokens, at
            # most high - tokens.
            if math.floor(fits) > low - shape.num_tokens:
                best = max(best, min(fits, high - shape.num_tokens))
        return best


def _root(per_token: float, per_pair: float, num_computed_tokens: int, slack: float) -> float:
    """The most n with q·n² + l·n ≤ slack: n new tokens after `num_computed_tokens` (ms)."""
    if math.isinf(slack):
        return math.inf
    quadratic = per_pair / PAIR_SCALE / 2
    linear = per_token / TOKEN_SCALE + per_pair / PAIR_SCALE * (num_computed_tokens + 0.5)
    denominator = linear + math.sqrt(linear * linear + 4 * quadratic * slack)
    if denominator <= 0:
        return math.inf
    return 2 * slack / denominator  # the positive root, in a form stable as q → 0


class PrefillBudget:
    """No limit beyond the step's token budget: the scheduler without a target step time."""

    token_budget: int | None = None  # the step's allowance, when a target sets one

    def grant(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Of `num_new_tokens` prompt tokens a request wants this step, how many it gets."""
        return num_new_tokens


class TargetStepBudget(PrefillBudget):
    """One step's prefill under a target step time.

    Built after the step's decode rows are known: they are counted first, and always get
    their token. Prefill rows then get what the predicted time leaves under the target,
    but the step's prefill rows together get at least `min_prefill_tokens` (they never
    stall behind decodes). Without chunked prefill a prompt is granted whole or not at
    all; the step's first prompt always is.
    """

    def __init__(
        self,
        cost_model: StepCostModel,
        target_ms: float,
        decode_shape: StepShape,
        min_prefill_tokens: int,
        max_num_batched_tokens: int,
        chunked: bool = True,
    ) -> None:
        self.cost_model = cost_model
        self.target_ms = target_ms
        self.shape = StepShape(decode_shape.num_tokens, decode_shape.attention_pairs)
        self.min_prefill_tokens = min_prefill_tokens
        self.chunked = chunked
        self.num_granted = 0
        # What a fresh prompt could get now: the adaptive budget the metrics report.
        fresh = cost_model.max_new_tokens(self.shape, 0, target_ms)
        allowance = max(min_prefill_tokens, int(min(fresh, max_num_batched_tokens)))
        self.token_budget = min(max_num_batched_tokens, decode_shape.num_tokens + allowance)

    def grant(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        fits = self.cost_model.max_new_tokens(self.shape, num_computed_tokens, self.target_ms)
        floor = max(self.min_prefill_tokens - self.num_granted, 0)
        if self.chunked:
            granted = min(num_new_tokens, max(int(min(fits, num_new_tokens)), floor))
        elif num_new_tokens <= fits or self.num_granted == 0:
            granted = num_new_tokens
        else:
            granted = 0
        if granted > 0:
            self.shape.add(num_computed_tokens, granted)
            self.num_granted += granted
        return granted
