"""`tokenserve tune`: search engine settings for a trace and an SLO, through the simulator.

Candidates vary the token budget, `max_num_seqs`, the block size (the KV memory kept:
the block count follows), the KV cache size, the prefill order and the target step time.
Each is simulated on the trace; those that meet every SLO bound rank first, by total
token throughput, then the others by how far they miss (the worst bound's ratio).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from dataclasses import dataclass
from typing import Any

from tokenserve.benchmarks.datasets import BenchRequest
from tokenserve.config import CacheConfig, SchedulerConfig
from tokenserve.core.step_cost import StepCostModel
from tokenserve.simulator.simulate import simulate

_BOUND = re.compile(r"^\s*([a-z_0-9]+)\s*([<>])\s*([0-9.eE+-]+)\s*(ms|s)?\s*$")
_LATENCY = re.compile(r"^(ttft|tpot|itl|e2el)_(mean|p50|p90|p99)$")


@dataclass(frozen=True)
class SloBound:
    metric: str  # e.g. ttft_p99, output_throughput
    op: str  # "<" or ">"
    value: float  # ms for latencies

    def value_of(self, summary: dict[str, Any]) -> float | None:
        if (match := _LATENCY.match(self.metric)) is not None:
            return summary[f"{match.group(1)}_ms"][match.group(2)]
        return summary.get(self.metric)

    def miss_ratio(self, summary: dict[str, Any]) -> float:
        """≤ 1 when met; how many times over (or under) the bound otherwise."""
        value = self.value_of(summary)
        if value is None:
            return math.inf
        if self.op == "<":
            return value / self.value if self.value > 0 else math.inf
        return self.value / value if value > 0 else math.inf

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}{'ms' if _LATENCY.match(self.metric) else ''}"


def parse_slo(text: str) -> list[SloBound]:
    """"ttft_p99<2s,itl_p99<200ms,output_throughput>50" → bounds (latencies in ms)."""
    bounds = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = _BOUND.match(part)
        if match is None:
            raise ValueError(f"SLO bound {part!r}: expected e.g. 'ttft_p99<2s' or 'itl_p50<80ms'.")
        metric, op, number, unit = match.groups()
        value = float(number)
        if _LATENCY.match(metric):
            value *= 1000.0 if unit == "s" else 1.0
        elif unit is not None or metric not in ("request_throughput", "output_throughput",
                                                "total_token_throughput"):
            raise ValueError(
                f"SLO bound {part!r}: the metric is a latency (ttft/tpot/itl/e2el _ "
                "mean/p50/p90/p99, in ms or s) or a throughput without a unit."
            )
        bounds.append(SloBound(metric, op, value))
    if not bounds:
        raise ValueError("--slo names no bound.")
    return bounds


@dataclass
class Candidate:
    settings: dict[str, Any]
    summary: dict[str, Any]
    miss: float  # the worst bound's ratio: ≤ 1 meets the SLO
    num_changes: int = 0  # settings that differ from the given ones

    @property
    def meets_slo(self) -> bool:
        return self.miss <= 1.0

    def rank_key(self) -> tuple[float, float, int]:
        # Ties (settings the simulator cannot tell apart) go to the fewest changes.
        if self.meets_slo:
            return (0.0, -round(self.summary["total_token_throughput"], 6), self.num_changes)
        return (1.0, round(self.miss, 9), self.num_changes)


@dataclass
class SearchSpace:
    max_num_batched_tokens: list[int]
    max_num_seqs: list[int]
    block_size: list[int]
    kv_cache_tokens: list[int]  # KV cache size, in token slots
    prefill_order: list[str]
    target_step_ms: list[float | None]
    long_prefill_token_threshold: list[int] = dataclasses.field(default_factory=lambda: [0])

    def settings(self) -> list[dict[str, Any]]:
        names = [f.name for f in dataclasses.fields(self)]
        return [dict(zip(names, values))
                for values in itertools.product(*(getattr(self, n) for n in names))]


def tune(
    requests: list[BenchRequest],
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    cost: dict[str, float | int],
    space: SearchSpace,
    slo: list[SloBound],
    given: dict[str, Any] | None = None,
) -> list[Candidate]:
    """Every candidate of `space`, simulated and ranked (best first; among equals, the
    one closest to the `given` settings)."""
    candidates = []
    for settings in space.settings():
        if not scheduler_config.enable_chunked_prefill and (
            settings["max_num_batched_tokens"] < scheduler_config.max_model_len
            or settings["long_prefill_token_threshold"] > 0
        ):
            continue
        scheduler, cache = configs_for(scheduler_config, cache_config, settings)
        if cache.num_blocks * cache.block_size < max(len(r.prompt_token_ids) for r in requests) + 1:
            continue  # a prompt could never be placed
        # A fresh model per run: under a target step time the scheduler holds it.
        summary = simulate(requests, scheduler, cache, StepCostModel.from_dict(cost)).summary()
        miss = max(bound.miss_ratio(summary) for bound in slo)
        changes = sum(1 for k, v in settings.items() if given is not None and given.get(k) != v)
        candidates.append(Candidate(settings, summary, miss, changes))
    if not candidates:
        raise ValueError("No candidate setting can hold the trace's longest prompt.")
    return sorted(candidates, key=Candidate.rank_key)


def configs_for(
    scheduler_config: SchedulerConfig, cache_config: CacheConfig, settings: dict[str, Any]
) -> tuple[SchedulerConfig, CacheConfig]:
    scheduler = dataclasses.replace(
        scheduler_config,
        max_num_batched_tokens=settings["max_num_batched_tokens"],
        max_num_seqs=settings["max_num_seqs"],
        prefill_order=settings["prefill_order"],
        target_step_ms=settings["target_step_ms"],
        long_prefill_token_threshold=settings["long_prefill_token_threshold"],
    )
    block_size = settings["block_size"]
    cache = dataclasses.replace(
        cache_config, block_size=block_size,
        num_blocks=max(1, settings["kv_cache_tokens"] // block_size),
    )
    return scheduler, cache


def serve_command(model: str | None, settings: dict[str, Any]) -> str:
    parts = ["tokenserve serve"] + ([model] if model else [])
    parts += [
        f"--max-num-batched-tokens {settings['max_num_batched_tokens']}",
        f"--max-num-seqs {settings['max_num_seqs']}",
        f"--block-size {settings['block_size']}",
        f"--num-kv-blocks {max(1, settings['kv_cache_tokens'] // settings['block_size'])}",
        f"--prefill-order {settings['prefill_order']}",
    ]
    if settings["target_step_ms"] is not None:
        parts.append(f"--target-step-ms {settings['target_step_ms']:g}")
    if settings["long_prefill_token_threshold"] > 0:
        parts.append(f"--long-prefill-token-threshold {settings['long_prefill_token_threshold']}")
    return " ".join(parts)


def format_table(candidates: list[Candidate], slo: list[SloBound], limit: int) -> str:
    header = (f"{'#':>3} {'budget':>6} {'seqs':>5} {'block':>5} {'kv_tok':>7} {'order':>8} "
              f"{'target':>6} {'lpt':>5} {'SLO':>4} {'miss':>5} {'tok/s':>8} "
              + " ".join(f"{b.metric!s:>10}" for b in slo))
    lines = [header]
    for rank, c in enumerate(candidates[:limit], 1):
        s = c.settings
        target = "-" if s["target_step_ms"] is None else f"{s['target_step_ms']:g}"
        threshold = s["long_prefill_token_threshold"] or "-"
        values = " ".join(f"{_cell(b.value_of(c.summary)):>10}" for b in slo)
        lines.append(
            f"{rank:>3} {s['max_num_batched_tokens']:>6} {s['max_num_seqs']:>5} "
            f"{s['block_size']:>5} {s['kv_cache_tokens']:>7} {s['prefill_order']:>8} "
            f"{target:>6} {threshold:>5} {'yes' if c.meets_slo else 'no':>4} {c.miss:>5.2f} "
            f"{c.summary['total_token_throughput']:>8.1f} {values}"
        )
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"
