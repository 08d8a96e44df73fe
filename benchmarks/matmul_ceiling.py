"""The CPU's matmul ceiling for a model's own GEMM shapes, float32 and bfloat16, and a W1
run stated as a fraction of it.

For each linear shape of the model (q/k/v, o, gate/up, down, the logits matrix) at the row
counts of W1's steps (512: a prefill chunk; 64: a decode step of 64 requests), the GEMM
tokenserve runs (oneDNN with the weight prepacked, `torch.ops.mkldnn._linear_pointwise`) is
timed in float32 and in bfloat16 (AMX / AVX512_BF16 where the CPU has them), the dtypes
taking turns, the fastest of `--repeats` kept (the machine may be shared). The ceiling of a
dtype is the FLOP-weighted rate over one pass of the model's products at those row counts.
With `--w1-json` (the output of `tokenserve bench throughput --output-json`), W1's model
FLOPs (2 x linear parameters x tokens through them, plus the logits rows) per second are
stated as a fraction of the ceiling of the run's dtype.

usage: python benchmarks/matmul_ceiling.py [--model GGUF_OR_DIR] [--rows 64 512]
       [--repeats 20] [--w1-json w1.json ...]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tokenserve.model.loader import resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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


def w1_flops(hf_config, result: dict) -> float:
    """W1's model FLOPs: every token through every layer's products, and one logits row per
    output token (prefill's last position samples the first)."""
    shapes = linear_shapes(hf_config)
    layer_params = sum(o * i for name, (o, i) in shapes.items() if name != "logits")
    tokens = result["prompt_tokens"] + result["output_tokens"]
    logits_out, logits_in = shapes["logits"]
    return (2 * layer_params * hf_config.num_hidden_layers * tokens
            + 2 * logits_out * logits_in * result["output_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Default: the default model.")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--w1-json", nargs="*", default=[],
                        help="`tokenserve bench throughput --output-json` results to rate.")
    args = parser.parse_args()
    hf_config = resolve_model(args.model).hf_config
    shapes = linear_shapes(hf_config)
    dtypes = list(DTYPES.values())
    ceiling = {}
    for rows in args.rows:
        seconds = dict.fromkeys(dtypes, 0.0)
        flops = 0.0
        for name, (out, inp) in shapes.items():
            # A layer's products once per layer; the logits matrix once.
            count = 1 if name == "logits" else hf_config.num_hidden_layers
            timed = time_gemm(rows, out, inp, dtypes, args.repeats)
            flops += 2 * rows * out * inp * count
            for dtype in dtypes:
                seconds[dtype] += timed[dtype] * count
            print(f"rows {rows:4d} {name:8s} [{out:5d} x {inp:5d}]  " + "  ".join(
                f"{str(d)[6:]} {2 * rows * out * inp / timed[d] / 1e9:7.1f} GFLOP/s"
                for d in dtypes))
        for dtype in dtypes:
            ceiling.setdefault(dtype, []).append(flops / seconds[dtype] / 1e9)
        print(f"rows {rows:4d} one pass over the model: " + "  ".join(
            f"{str(d)[6:]} {flops / seconds[d] / 1e9:.1f} GFLOP/s" for d in dtypes))
    summary = {str(d)[6:]: max(values) for d, values in ceiling.items()}
    print("Ceiling (best row count): " + ", ".join(f"{k} {v:.1f} GFLOP/s"
                                                  for k, v in summary.items()))
    for path in args.w1_json:
        with open(path) as file:
            result = json.load(file)
        dtype = str(result["engine_args"].get("dtype", "auto"))
        rate = w1_flops(hf_config, result) / result["elapsed_time"] / 1e9
        fraction = ", ".join(f"{rate / v:.2f} of the {k} ceiling" for k, v in summary.items())
        print(f"{path}: dtype {dtype}, {result['total_tokens_per_second']:.1f} total tok/s, "
              f"{rate:.1f} model GFLOP/s = {fraction}")


if __name__ == "__main__":
    main()
