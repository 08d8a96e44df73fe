"""benchmarks/matmul_ceiling.py on a tiny model: the GEMM rates of its shapes per dtype and row
count, the read rates, the model's FLOPs per token, and W1 stated against the ceiling.

Rates depend on the host, so only their shape is checked (finite, positive, the ceiling the
best row count's); the FLOPs per token are exact and computed here from the model's config.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

from tokenserve.kernels import cpu_isa

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "matmul_ceiling.py"


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300, check=False)


def test_ceiling_read_rates_and_flops_per_token(tiny_model_dirs, tmp_path: Path):
    model = tiny_model_dirs["llama"]
    w1 = tmp_path / "w1.json"
    w1.write_text(json.dumps({"engine_args": {"dtype": "float32"}, "elapsed_time": 2.0,
                              "prompt_tokens": 1000, "output_tokens": 500,
                              "total_tokens_per_second": 750.0}))
    output = tmp_path / "ceilings.json"
    result = run_script("--model", model, "--rows", "4", "8", "--dtypes", "float32",
                        "--repeats", "2", "--read-mib", "1", "2", "--json", str(output),
                        "--w1-json", str(w1))
    assert result.returncode == 0, result.stderr
    data = json.loads(output.read_text())
    rates = data["gflops"]["float32"]
    assert set(rates) == {"4", "8"}
    assert all(math.isfinite(rate) and rate > 0 for rate in rates.values())
    assert data["ceiling_gflops"] == {"float32": max(rates.values())}
    assert set(data["read_gb_per_s"]) == {"1", "2"}
    assert all(math.isfinite(rate) and rate > 0 for rate in data["read_gb_per_s"].values())
    # One token through every layer's q/k/v, o, gate/up and down products; a logits row.
    config = json.loads((Path(model) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    per_layer = qkv * hidden + hidden * hidden + 2 * inter * hidden + hidden * inter
    layer_flops = 2 * per_layer * config["num_hidden_layers"]
    logits_flops = 2 * config["vocab_size"] * hidden
    assert data["layer_flops_per_token"] == layer_flops
    assert data["logits_flops_per_row"] == logits_flops
    # W1: 1,500 tokens through the layers and 500 logits rows in 2 s.
    gflops = (layer_flops * 1500 + logits_flops * 500) / 2.0 / 1e9
    assert data["w1"] == [{"path": str(w1), "dtype": "float32", "model_gflops": gflops}]
    ceiling = data["ceiling_gflops"]["float32"]
    assert f"Ceiling (best row count): float32 {ceiling:.1f} GFLOP/s" in result.stdout
    assert f"= {gflops / ceiling:.2f} of the float32 ceiling" in result.stdout
    assert re.search(r"Read rate \(torch\.sum over float32, \d+ threads\): [\d.]+ GB/s over 1 "
                     r"MiB, [\d.]+ GB/s over 2 MiB", result.stdout)


def test_native_dtypes_are_float32_and_bfloat16_where_the_cpu_has_it(tiny_model_dirs,
                                                                      tmp_path: Path):
    output = tmp_path / "ceilings.json"
    result = run_script("--model", tiny_model_dirs["llama"], "--rows", "4", "--dtypes", "native",
                        "--repeats", "1", "--read-mib", "0", "--json", str(output))
    assert result.returncode == 0, result.stderr
    data = json.loads(output.read_text())
    expected = ["float32", "bfloat16"] if cpu_isa.native_bf16() else ["float32"]
    assert list(data["ceiling_gflops"]) == expected
    assert data["read_gb_per_s"] == {} and "Read rate" not in result.stdout


def test_refuses_no_repeats(tiny_model_dirs):
    result = run_script("--model", tiny_model_dirs["llama"], "--repeats", "0")
    assert result.returncode == 2
    assert "--repeats and --rows must be positive" in result.stderr
