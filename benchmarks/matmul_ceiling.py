"""The CPU's matmul ceiling for a model's own GEMM shapes, float32 and bfloat16, the rate it
reads memory at, and a W1 run stated as a fraction of the ceiling.

For each linear shape of the model (q/k/v, o, gate/up, down, the logits matrix) at the row
counts of W1's steps (512: a prefill chunk; 64: a decode step of 64 requests), the GEMM
tokenserve runs (oneDNN with the weight prepacked, `torch.ops.mkldnn._linear_pointwise`) is
timed in float32 and in bfloat16 (AMX / AVX512_BF16 where the CPU has them), the dtypes
taking turns, the fastest of `--repeats` kept (the machine may be shared). The ceiling of a
dtype is the FLOP-weighted rate over one pass of the model's products at those row counts.
`--dtypes native` times bfloat16 only where the CPU computes it natively (elsewhere a bf16
matmul is tens of times slower and its ceiling says nothing). The read rates are `torch.sum`
over each `--read-mib` of float32 on torch's threads, the fastest of `--repeats`: a decode
step cannot read its weights and KV cache faster. 96 MiB is what a few-row decode step of
the default model reads (its weights' 8-bit copies and the logits matrix), held in L3 by a
CPU with a large L3 when the host's other guests leave it room; 512 MiB comes from memory
(0: not measured). These are the two physical limits WORKLOADS.md names; on a shared host
both move from hour to hour, so a sitting (benchmarks/run_side_by_side.sh) measures them at
its start and end, and `--json` writes them, with the model's FLOPs per token, for its
report.
With `--w1-json` (the output of `tokenserve bench throughput --output-json`), W1's model
FLOPs (2 x linear parameters x tokens through them, plus the logits rows) per second are
stated as a fraction of the ceiling of each dtype.

usage: python benchmarks/matmul_ceiling.py [--model GGUF_OR_DIR] [--rows 64 512]
       [--dtypes float32 bfloat16 | native] [--repeats 20] [--read-mib 96 512] [--json FILE]
       [--w1-json w1.json ...]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tokenserve.kernels import cpu_isa
from tokenserve.model.loader import resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def chosen_dtypes(names: list[str]) -> list[str]:
    """The dtypes to time: the names given, "native" standing for float32 and, where the
    CPU computes it natively, bfloat16."""
    native = ["float32", "bfloat16"] if cpu_isa.native_bf16() else ["float32"]
    chosen: list[str] = []
    for name in names:
        for dtype in native if name == "native" else [name]:
            if dtype not in chosen:
                chosen.append(dtype)
    return chosen


def read_rate(mib: float, repeats: int) -> float:
    """GB/s of `torch.sum` over `mib` MiB of float32 on torch's threads, the fastest of
    `repeats` passes (the tensor's pages are resident before the first)."""
    data = torch.ones(max(1, int(mib * 2**20) // 4), dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def linear_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """[out, in] of one decoder layer's products, and the logits matrix."""
    hidden = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    qkv = (hf_config.num_attention_heads + 2 * hf_config.num_key_value_heads) * head_dim
    inter = hf_config.intermediate_size
    return {"qkv": (qkv, hidden), "o": (hidden, hf_config.num_attention_heads * head_dim),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter),
            "logits": (hf_config.vocab_size, hidden)}


def time_gemm(rows: int, out: int, inp: int, dtypes: list[torch.dtype], repeats: int
              ) -> dict[torch.dtype, float]:
    """Fastest seconds of x [rows, inp] · Wᵀ per dtype, the dtypes taking turns."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out, inp, generator=generator)
    x = torch.randn(rows, inp, generator=generator)
    calls = {}
    for dtype in dtypes:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), None)
        xd = x.to(dtype)
        calls[dtype] = (lambda xd=xd, packed=packed:
                        torch.ops.mkldnn._linear_pointwise(xd, packed, None, "none", [], ""))
        for _ in range(3):
            calls[dtype]()
    best = dict.fromkeys(dtypes, float("inf"))
    for _ in range(repeats):
        for dtype in dtypes:
            start = time.perf_counter()
            calls[dtype]()
            best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best


def flops_per_token(hf_config) -> tuple[int, int]:
    """The model's FLOPs for a token through every layer's products, and for a logits row."""
    shapes = linear_shapes(hf_config)
    layer_params = sum(o * i for name, (o, i) in shapes.items() if name != "logits")
    logits_out, logits_in = shapes["logits"]
    return 2 * layer_params * hf_config.num_hidden_layers, 2 * logits_out * logits_in


def w1_flops(hf_config, result: dict) -> float:
    """W1's model FLOPs: every token through every layer's products, and one logits row per
    output token (prefill's last position samples the first)."""
    layer, logits = flops_per_token(hf_config)
    tokens = result["prompt_tokens"] + result["output_tokens"]
    return layer * tokens + logits * result["output_tokens"]


def measure_ceilings(hf_config, rows_list: list[int], dtype_names: list[str], repeats: int
                     ) -> dict[str, dict[int, float]]:
    """GFLOP/s of one pass over the model's products per dtype and row count, printing each
    shape's rate on the way."""
    shapes = linear_shapes(hf_config)
    dtypes = [DTYPES[name] for name in dtype_names]
    rates: dict[str, dict[int, float]] = {name: {} for name in dtype_names}
    for rows in rows_list:
        seconds = dict.fromkeys(dtypes, 0.0)
        flops = 0.0
        for name, (out, inp) in shapes.items():
            # A layer's products once per layer; the logits matrix once.
            count = 1 if name == "logits" else hf_config.num_hidden_layers
            timed = time_gemm(rows, out, inp, dtypes, repeats)
            flops += 2 * rows * out * inp * count
            for dtype in dtypes:
                seconds[dtype] += timed[dtype] * count
            print(f"rows {rows:4d} {name:8s} [{out:5d} x {inp:5d}]  " + "  ".join(
                f"{str(d)[6:]} {2 * rows * out * inp / timed[d] / 1e9:7.1f} GFLOP/s"
                for d in dtypes))
        for name, dtype in zip(dtype_names, dtypes):
            rates[name][rows] = flops / seconds[dtype] / 1e9
        print(f"rows {rows:4d} one pass over the model: " + "  ".join(
            f"{name} {rates[name][rows]:.1f} GFLOP/s" for name in dtype_names))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Default: the default model.")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=[*DTYPES, "native"],
                        help="native: float32, and bfloat16 where the CPU computes it natively.")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--read-mib", type=float, nargs="+", default=[96, 512],
                        help="MiB of float32 read by torch.sum, each a read rate (0: none).")
    parser.add_argument("--json", default=None, help="Also write the figures to this file.")
    parser.add_argument("--w1-json", nargs="*", default=[],
                        help="`tokenserve bench throughput --output-json` results to rate.")
    args = parser.parse_args()
    if args.repeats < 1 or min(args.read_mib) < 0 or min(args.rows) < 1:
        parser.error("--repeats and --rows must be positive, --read-mib not negative.")
    hf_config = resolve_model(args.model).hf_config
    dtype_names = chosen_dtypes(args.dtypes)
    rates = measure_ceilings(hf_config, args.rows, dtype_names, args.repeats)
    summary = {name: max(by_rows.values()) for name, by_rows in rates.items()}
    print("Ceiling (best row count): " + ", ".join(f"{k} {v:.1f} GFLOP/s"
                                                  for k, v in summary.items()))
    read = {f"{mib:g}": read_rate(mib, args.repeats) for mib in args.read_mib if mib}
    if read:
        print("Read rate (torch.sum over float32, "
              f"{torch.get_num_threads()} threads): " + ", ".join(
                  f"{rate:.1f} GB/s over {mib} MiB" for mib, rate in read.items()))
    layer_flops, logits_flops = flops_per_token(hf_config)
    w1 = []
    for path in args.w1_json:
        with open(path) as file:
            result = json.load(file)
        dtype = str(result["engine_args"].get("dtype", "auto"))
        rate = w1_flops(hf_config, result) / result["elapsed_time"] / 1e9
        fraction = ", ".join(f"{rate / v:.2f} of the {k} ceiling" for k, v in summary.items())
        print(f"{path}: dtype {dtype}, {result['total_tokens_per_second']:.1f} total tok/s, "
              f"{rate:.1f} model GFLOP/s = {fraction}")
        w1.append({"path": path, "dtype": dtype, "model_gflops": rate})
    if args.json:
        with open(args.json, "w") as file:
            json.dump({
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "threads": torch.get_num_threads(),
                "gflops": {name: {str(rows): rate for rows, rate in by_rows.items()}
                           for name, by_rows in rates.items()},
                "ceiling_gflops": summary,
                "read_gb_per_s": read,  # by MiB read
                "layer_flops_per_token": layer_flops,
                "logits_flops_per_row": logits_flops,
                "w1": w1,
            }, file, indent=2)


if __name__ == "__main__":
    main()
