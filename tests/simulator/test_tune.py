"""`tokenserve tune`: SLO parsing, ranking, and the simulate / tune commands end to end
(a tiny model's config for the engine settings, a fixed cost.json for the step times)."""

from __future__ import annotations

import json

import pytest

from tests.simulator.test_simulate import COST, configs
from tokenserve.benchmarks import mooncake
from tokenserve.entrypoints.cli import main
from tokenserve.metrics.request_trace import TraceEntry
from tokenserve.simulator import tune

# Short requests decoding while two long prompts arrive: a big token budget puts a long
# prompt step between two of their tokens.
MIXED_TRACE = [TraceEntry(200 + 200 * i, 1536, 4, [i, i + 10, i + 20]) for i in range(2)] + [
    TraceEntry(100 * k, 64, 32, [1000 + k]) for k in range(6)
]


def test_parse_slo():
    bounds = tune.parse_slo("ttft_p99<2s, itl_p99<200ms,output_throughput>5")
    assert [(b.metric, b.op, b.value) for b in bounds] == [
        ("ttft_p99", "<", 2000.0), ("itl_p99", "<", 200.0), ("output_throughput", ">", 5.0)]
    for bad in ("ttft<2s", "itl_p99=3ms", "output_throughput>5ms", ""):
        with pytest.raises(ValueError):
            tune.parse_slo(bad)


def test_tune_prefers_a_small_budget_for_an_itl_slo():
    requests = mooncake.trace_requests(MIXED_TRACE, 1000)
    slo = tune.parse_slo("itl_p99<40ms")
    space = tune.SearchSpace([128, 512, 2048], [64], [16], [8192], ["shortest"], [None])
    ranked = tune.tune(requests, *configs(budget=2048), COST, space, slo)
    assert len(ranked) == 3
    met = [c.settings["max_num_batched_tokens"] for c in ranked if c.meets_slo]
    assert sorted(met) == [128, 512] and ranked[-1].settings["max_num_batched_tokens"] == 2048
    assert ranked[-1].summary["itl_ms"]["p99"] > 40
    # Among those that meet it, the higher throughput ranks first.
    assert ranked[0].summary["total_token_throughput"] >= ranked[1].summary["total_token_throughput"]
    assert "--max-num-batched-tokens 512" in tune.serve_command("m", ranked[0].settings)


def test_tune_finds_a_long_prefill_threshold_for_an_itl_slo():
    # At the full budget, capping each prompt's tokens a step keeps the decodes' ITL within
    # the SLO the uncapped budget misses, as a small budget does.
    requests = mooncake.trace_requests(MIXED_TRACE, 1000)
    slo = tune.parse_slo("itl_p99<40ms")
    space = tune.SearchSpace([2048], [64], [16], [8192], ["shortest"], [None], [0, 256])
    ranked = tune.tune(requests, *configs(budget=2048), COST, space, slo)
    assert [(c.settings["long_prefill_token_threshold"], c.meets_slo) for c in ranked] == [
        (256, True), (0, False)]
    assert "--long-prefill-token-threshold 256" in tune.serve_command("m", ranked[0].settings)
    assert "--long-prefill-token-threshold" not in tune.serve_command("m", ranked[1].settings)
    assert " 256 " in tune.format_table(ranked, slo, 2).splitlines()[1]


def test_simulate_and_tune_commands(tiny_model_dirs, tmp_path, capsys):
    trace, cost = tmp_path / "trace.jsonl", tmp_path / "cost.json"
    mooncake.write_trace(MIXED_TRACE, str(trace))
    cost.write_text(json.dumps(COST))
    engine = ["--model", tiny_model_dirs["llama"], "--max-model-len", "2048", "--block-size", "16",
              "--max-num-batched-tokens", "2048"]
    out = tmp_path / "sim.json"
    assert main(["simulate", "--trace", str(trace), "--cost-model", str(cost),
                 "--output-json", str(out), *engine]) == 0
    report = json.loads(out.read_text())
    assert report["summary"]["completed"] == len(MIXED_TRACE)
    assert report["settings"]["max_num_batched_tokens"] == 2048
    assert "ttft_ms" in report["summary"] and "prefix_cache_hit_rate" in report["summary"]
    tuned = tmp_path / "tune.json"
    assert main(["tune", "--trace", str(trace), "--cost-model", str(cost), "--slo", "itl_p99<40ms",
                 "--budgets", "128,2048", "--num-seqs", "64", "--block-sizes", "16",
                 "--prefill-orders", "shortest", "--target-steps", "none",
                 "--output-json", str(tuned), *engine]) == 0
    printed = capsys.readouterr().out
    assert "tokenserve serve" in printed and "--max-num-batched-tokens 128" in printed
    result = json.loads(tuned.read_text())
    assert result["candidates"][0]["meets_slo"] and not result["baseline"]["summary"]["itl_ms"]["p99"] < 40
    assert main(["simulate", "--trace", str(tmp_path / "missing.jsonl"), "--cost-model", str(cost),
                 *engine]) == 2


def test_calibrate_fits_the_served_steps(tiny_model_dirs, tmp_path, capsys):
    """`tokenserve calibrate` runs the engine as a server does and writes a fit simulate reads."""
    cost = tmp_path / "cost.json"
    # A budget of 512 splits the decode rounds' prompts over several steps: at the default
    # (2048) the quick rounds' steps are fewer, some runs under 20.
    assert main(["calibrate", tiny_model_dirs["llama"], "--quick", "--max-model-len", "512",
                 "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
                 "-o", str(cost)]) == 0
    fit = json.loads(cost.read_text())
    assert fit["num_samples"] >= 20 and fit["calibration"]["num_steps"] >= 20
    # Every coefficient of the fit, the shared terms and each kernel regime's (KernelConfig's
    # row limits), non-negative and not all 0. Which terms take the steps' time is the
    # host's: a tiny model's steps of over 192 rows may cost no more than the regimes below
    # price them, leaving the oneDNN regime's terms at 0.
    coefficients = [fit["intercept_ms"], fit["ms_per_1k_tokens"], fit["ms_per_1m_attention_pairs"],
                    fit["ms_per_1k_decode_tokens"]]
    for regime in fit["kernel_regimes"]:
        coefficients += [regime["intercept_ms"], regime["ms_per_1k_rows"]]
    assert all(c >= 0 for c in coefficients) and any(c > 0 for c in coefficients)
    # The lone requests' delays.
    assert [r["max_rows"] for r in fit["kernel_regimes"]] == [10, 192]
    assert fit["arrival_delay_ms"] >= 0 and fit["output_delay_ms"] >= 0
    assert fit["calibration"]["request_delays_ms"]
    assert "step_ms =" in capsys.readouterr().out
