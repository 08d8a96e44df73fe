"""Serving-benchmark figures from per-request results: throughput and latency percentiles.

TTFT: send → first chunk with a choice. TPOT: (latency - TTFT) / (output tokens - 1), per
request. ITL: the gaps between a request's chunks, pooled over requests. E2EL: send →
end of stream. Each is reported as mean, p50, p90 and p99 in milliseconds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenserve.benchmarks.openai_client import RequestResult

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
# The order groups are printed in; "all" is the only group of the uniform datasets.
GROUP_ORDER = ("short", "long")


def distribution_ms(seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    values = np.asarray(seconds) * 1000.0
    return {
        "mean": float(values.mean()),
        **{f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES},
    }


def latency_figures(results: list[RequestResult]) -> dict[str, dict[str, float | None]]:
    done = [r for r in results if r.success]
    samples = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [t for r in done if (t := r.time_per_output_token) is not None],
        "itl": [gap for r in done for gap in r.inter_token_latencies],
        "e2el": [r.latency for r in done],
    }
    return {f"{name}_ms": distribution_ms(samples[name]) for name in LATENCY_METRICS}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Counts, throughput over the whole run, latencies overall and per group."""
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else 0.0,
        # From usage.prompt_tokens_details (tokenserve; vLLM with --enable-prompt-tokens-details).
        "cached_prompt_tokens": sum(cached) if len(cached) == len(done) and done else None,
        **latency_figures(results),
    }
    groups = sorted({r.group for r in results}, key=_group_rank)
    if groups != ["all"]:
        summary["groups"] = {
            group: {
                "completed": sum(1 for r in done if r.group == group),
                "output_tokens": sum(r.output_tokens for r in done if r.group == group),
                **latency_figures([r for r in results if r.group == group]),
            }
            for group in groups
        }
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        "============ Serving benchmark ============",
        f"Successful requests:          {summary['completed']}",
        f"Failed requests:              {summary['failed']}",
        f"Duration (s):                 {summary['duration_s']:.2f}",
        f"Input tokens:                 {summary['total_input_tokens']}",
        f"Output tokens:                {summary['total_output_tokens']}",
        f"Request throughput (req/s):   {summary['request_throughput']:.2f}",
        f"Output token throughput (tok/s): {summary['output_throughput']:.1f}",
        f"Total token throughput (tok/s):  {summary['total_token_throughput']:.1f}",
    ]
    if summary.get("prefix_cache_hit_rate") is not None:
        lines.append(f"Prefix cache hit rate:        {summary['prefix_cache_hit_rate']:.3f}")
    if summary.get("num_preemptions") is not None:
        lines.append(f"Preemptions:                  {summary['num_preemptions']:.0f}")
    lines += _latency_lines(summary, "")
    for group, figures in summary.get("groups", {}).items():
        lines.append(f"---- {group} requests ({figures['completed']} completed) ----")
        lines += _latency_lines(figures, "  ")
    lines.append("=" * 43)
    return "\n".join(lines)


def _latency_lines(figures: dict[str, Any], indent: str) -> list[str]:
    lines = []
    for name in LATENCY_METRICS:
        stats = figures[f"{name}_ms"]
        cells = "  ".join(
            f"{key} {value:8.1f}" if value is not None else f"{key}      n/a"
            for key, value in stats.items()
        )
        lines.append(f"{indent}{name.upper():5} ms  {cells}")
    return lines


def _group_rank(group: str) -> tuple[int, str]:
    return (GROUP_ORDER.index(group) if group in GROUP_ORDER else len(GROUP_ORDER), group)
