"""`tokenserve bench throughput` end to end on a tiny model, through the CLI's main()."""

from __future__ import annotations

import json
from pathlib import Path

from tokenserve.entrypoints.cli import main


def run_bench(tiny_model_dirs: dict[str, str], tmp_path: Path, *extra: str) -> dict:
    output = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", tiny_model_dirs["llama"], "--kv-cache-memory",
            "64MiB", "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
            "--output-json", str(output), *extra]
    assert main(argv) == 0
    return json.loads(output.read_text())


def test_bench_throughput_counts_every_token(tiny_model_dirs, tmp_path, capsys):
    result = run_bench(tiny_model_dirs, tmp_path)

    assert result["num_requests"] == 4
    assert result["prompt_tokens"] == 4 * 16
    assert result["output_tokens"] == 4 * 4  # EOS ignored: exactly --output-len each
    for key in ("requests_per_second", "output_tokens_per_second", "total_tokens_per_second",
                "elapsed_time", "load_time"):
        assert result[key] > 0, key
    assert result["engine_args"]["kv_cache_memory"] == "64MiB"
    assert "Throughput:" in capsys.readouterr().out


def test_bench_throughput_shared_prefix_hits_the_cache(tiny_model_dirs, tmp_path):
    result = run_bench(tiny_model_dirs, tmp_path, "--prefix-len", "32", "--block-size", "8")

    assert result["prompt_tokens"] == 4 * (32 + 16)
    assert result["prefix_cache_hit_rate"] > 0


def test_bench_throughput_refuses_bad_lengths(tiny_model_dirs, tmp_path, capsys):
    argv = ["bench", "throughput", "--model", tiny_model_dirs["llama"], "--output-len", "0"]
    assert main(argv) == 2
    assert "--output-len must be at least 1" in capsys.readouterr().err


def test_bench_throughput_takes_lora_adapters_in_turn(tiny_model_dirs, lora_adapters, tmp_path):
    result = run_bench(
        tiny_model_dirs, tmp_path, "--enable-lora", "--max-loras", "2", "--lora-modules",
        f"a0={lora_adapters['a0']}", f"a1={lora_adapters['a1']}",
    )
    assert result["lora_modules"] == ["a0", "a1"]
    assert result["output_tokens"] == 4 * 4
