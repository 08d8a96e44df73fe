"""The `tokenserve simulate`, `calibrate` and `tune` subcommands (docs/DIAGNOSIS.md)."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from tokenserve.benchmarks import mooncake
from tokenserve.benchmarks.serve_metrics import format_summary
from tokenserve.config import EngineConfig
from tokenserve.core.step_cost import StepCostModel
from tokenserve.engine.cli_args import add_engine_arguments, engine_args_from
from tokenserve.engine.engine_args import parse_memory
from tokenserve.simulator import calibrate, simulate, tune

logger = logging.getLogger(__name__)


def add_diagnosis_parsers(
    subcommands: Any, serving_app: Callable[[Any], Any] | None = None
) -> None:
    """Add `simulate`, `calibrate` and `tune`. `serving_app` builds the OpenAI app for an
    engine, so that calibration serves it over HTTP as `tokenserve serve` does (the
    command line passes it in: the simulator imports nothing of entrypoints)."""
    sim = subcommands.add_parser(
        "simulate",
        help="Predict bench serve's figures for a trace: the real scheduler, no model.",
        description="Replays a Mooncake-format trace through the real Scheduler and "
                    "KVCacheManager on a virtual clock, each step timed by the calibrated "
                    "step-cost model; prints bench serve's figures plus the prefix-cache hit "
                    "rate and preemptions.",
    )
    _add_trace_arguments(sim)
    sim.add_argument("--output-json", default=None, help="Write the figures here (bench serve's keys).")
    add_engine_arguments(sim, positional_model=False)
    sim.set_defaults(handler=functools.partial(_run_simulate, serving_app=serving_app))

    cal = subcommands.add_parser(
        "calibrate",
        help="Fit the step-cost model on this machine (cost.json for simulate and tune).",
        description="Runs the model in process through prompt chunks and decode batches of "
                    "several shapes and fits step_ms = a + b*prompt_tokens + c*attention_pairs "
                    "+ d*decode_tokens.",
    )
    cal.add_argument("-o", "--output", default="cost.json", help="Where to write the fit.")
    cal.add_argument("--quick", action="store_true", help="Fewer rounds (what simulate does on the fly).")
    add_engine_arguments(cal, positional_model=True)
    cal.set_defaults(handler=functools.partial(_run_calibrate, serving_app=serving_app))

    tun = subcommands.add_parser(
        "tune",
        help="Search engine settings for a trace and an SLO through the simulator.",
        description="Simulates the trace under every combination of the candidate settings, "
                    "ranks them (SLO met first, by total token throughput) and prints the "
                    "tokenserve serve command of the best.",
    )
    _add_trace_arguments(tun)
    tun.add_argument("--slo", required=True,
                     help='Bounds, e.g. "ttft_p99<2s,itl_p99<200ms" (ttft/tpot/itl/e2el with '
                          "mean/p50/p90/p99; or request/output/total_token_throughput>N).")
    tun.add_argument("--budgets", default="128,256,512,1024,2048",
                     help="max_num_batched_tokens candidates.")
    tun.add_argument("--num-seqs", default="16,64,128", help="max_num_seqs candidates.")
    tun.add_argument("--block-sizes", default="16,128", help="block_size candidates.")
    tun.add_argument("--kv-sizes", default=None,
                     help="KV cache sizes to try (bytes or e.g. '64MiB', comma-separated; "
                          "default: the configured one).")
    tun.add_argument("--prefill-orders", default="shortest,arrival", help="prefill_order candidates.")
    tun.add_argument("--target-steps", default="none,100,250",
                     help="target_step_ms candidates ('none': no target).")
    tun.add_argument("--long-prefill-thresholds", default="0",
                     help="long_prefill_token_threshold candidates (0: no limit), e.g. "
                          "0,128,512.")
    tun.add_argument("--top", type=int, default=10, help="Rows of the ranked table.")
    tun.add_argument("--output-json", default=None, help="Write every candidate's figures here.")
    add_engine_arguments(tun, positional_model=False)
    tun.set_defaults(handler=functools.partial(_run_tune, serving_app=serving_app))


def _add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="Mooncake-format trace (JSONL).")
    parser.add_argument("--cost-model", default=None,
                        help="cost.json from tokenserve calibrate (default: calibrate now, "
                             "quickly, with these engine settings).")


def _setup(
    args: argparse.Namespace, serving_app: Callable[[Any], Any] | None
) -> tuple[EngineConfig, list, StepCostModel, dict]:
    entries = mooncake.read_trace(args.trace)
    config = engine_args_from(args).create_engine_config()
    if args.cost_model is not None:
        cost_model = calibrate.read_cost_file(args.cost_model)
    else:
        logger.info("No --cost-model: calibrating on this machine (quick).")
        cost_model, report = calibrate.calibrate(config, quick=True, serving_app=serving_app)
        logger.info("Calibrated in %.1f s: %s", report["seconds"], cost_model.to_dict())
    vocab_size = int(getattr(config.model_config.hf_config, "vocab_size", 32000))
    requests = mooncake.trace_requests(entries, vocab_size)
    return config, requests, cost_model, cost_model.to_dict()


def _run_simulate(args: argparse.Namespace, serving_app: Callable[[Any], Any] | None) -> int:
    config, requests, cost_model, cost = _setup(args, serving_app)
    started = time.perf_counter()
    result = simulate.simulate(requests, config.scheduler_config, config.cache_config, cost_model)
    wall = time.perf_counter() - started
    summary = result.summary()
    summary["simulation_wall_s"] = wall
    summary["realtime_ratio"] = simulate.realtime_ratio(result, wall)
    print(format_summary(summary))
    print(f"Simulated {result.duration_s:.2f} s in {wall:.3f} s ({summary['realtime_ratio']:.0f}x real time)")
    if args.output_json:
        report = {"trace": args.trace, "cost_model": cost, "summary": summary,
                  "settings": _settings_of(config)}
        with open(args.output_json, "w") as file:
            json.dump(report, file, indent=2)
    return 0


def _run_calibrate(args: argparse.Namespace, serving_app: Callable[[Any], Any] | None) -> int:
    config = engine_args_from(args).create_engine_config()
    model, report = calibrate.calibrate(config, quick=args.quick, serving_app=serving_app)
    calibrate.write_cost_file(args.output, model, config, report)
    fit = model.to_dict()
    print(f"step_ms = {fit['intercept_ms']:.3f} + {fit['ms_per_1k_tokens']:.3f}*prompt_tokens/1e3 "
          f"+ {fit['ms_per_1m_attention_pairs']:.3f}*pairs/1e6 "
          f"+ {fit['ms_per_1k_decode_tokens']:.3f}*decode_tokens/1e3"
          + "".join(f"; at most {r['max_rows']} rows: {r['intercept_ms']:.3f} "
                    f"+ {r['ms_per_1k_rows']:.3f}*rows/1e3 instead of the intercept"
                    for r in fit.get("kernel_regimes", []))
          + f"; per request {fit['arrival_delay_ms']:.1f} ms in, {fit['output_delay_ms']:.1f} ms out"
          f"  ({report['num_steps']} steps, "
          f"median error {report['median_relative_error']:.1%}, {report['seconds']:.1f} s) "
          f"-> {args.output}")
    return 0


def _run_tune(args: argparse.Namespace, serving_app: Callable[[Any], Any] | None) -> int:
    slo = tune.parse_slo(args.slo)
    config, requests, _, cost = _setup(args, serving_app)
    kv_bytes_per_token = config.model_config.kv_bytes_per_token(config.cache_config.dtype)
    if args.kv_sizes:
        kv_tokens = [parse_memory(size) // kv_bytes_per_token for size in _list(args.kv_sizes, str)]
    else:
        kv_tokens = [config.cache_config.num_token_slots]
    space = tune.SearchSpace(
        max_num_batched_tokens=_list(args.budgets, int),
        max_num_seqs=_list(args.num_seqs, int),
        block_size=_list(args.block_sizes, int),
        kv_cache_tokens=kv_tokens,
        prefill_order=_list(args.prefill_orders, str),
        target_step_ms=[None if t.lower() == "none" else float(t)
                        for t in _list(args.target_steps, str)],
        long_prefill_token_threshold=_list(args.long_prefill_thresholds, int),
    )
    defaults = {"max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                "max_num_seqs": config.scheduler_config.max_num_seqs,
                "block_size": config.cache_config.block_size,
                "kv_cache_tokens": config.cache_config.num_token_slots,
                "prefill_order": config.scheduler_config.prefill_order,
                "target_step_ms": config.scheduler_config.target_step_ms,
                "long_prefill_token_threshold":
                    config.scheduler_config.long_prefill_token_threshold}
    started = time.perf_counter()
    ranked = tune.tune(requests, config.scheduler_config, config.cache_config, cost, space, slo,
                       defaults)
    baseline = tune.tune(requests, config.scheduler_config, config.cache_config, cost,
                         tune.SearchSpace(**{k: [v] for k, v in defaults.items()}), slo)[0]
    print(f"{len(ranked)} candidates simulated in {time.perf_counter() - started:.1f} s; "
          f"SLO {', '.join(map(str, slo))}")
    print(tune.format_table(ranked, slo, args.top))
    print("given settings: " + tune.format_table([baseline], slo, 1).splitlines()[1][4:])
    best = ranked[0]
    if not best.meets_slo:
        print(f"No candidate meets the SLO; the closest misses by {best.miss:.2f}x.")
    print(tune.serve_command(args.model, best.settings))
    if args.output_json:
        with open(args.output_json, "w") as file:
            json.dump({"slo": [str(b) for b in slo], "cost_model": cost,
                       "baseline": {"settings": baseline.settings, "summary": baseline.summary},
                       "candidates": [{"settings": c.settings, "meets_slo": c.meets_slo,
                                       "miss": c.miss, "summary": c.summary} for c in ranked]},
                      file, indent=2)
    return 0


def _list(text: str, kind: type) -> list:
    try:
        return [kind(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(f"Cannot read the list {text!r}: {error}") from None


def _settings_of(config: EngineConfig) -> dict[str, Any]:
    scheduler, cache = config.scheduler_config, config.cache_config
    return {"max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "max_num_seqs": scheduler.max_num_seqs, "block_size": cache.block_size,
            "num_kv_blocks": cache.num_blocks, "enable_prefix_caching": cache.enable_prefix_caching,
            "prefill_order": scheduler.prefill_order, "target_step_ms": scheduler.target_step_ms,
            "long_prefill_token_threshold": scheduler.long_prefill_token_threshold}
