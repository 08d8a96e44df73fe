"""How oneDNN's bf16 products use the threads: each projection shape of the default model
(or `--shapes`), at each row count, on 1 thread and on all of them, with its weight packed
as the model packs it (`_reorder_linear_weight(w, None)`) or for another batch size
(`--pack-hints`, e.g. 1).

A product whose time does not drop with the second thread is one oneDNN runs on a single
thread for that row count (its brgemm partition), not one the hardware caps: the same
shape a few rows away, or packed for another batch size, does drop. The weights stream as
in a model's pass (`--layers` copies of each shape, taken in turn, so that each product
reads its weight from the last-level cache or memory, not from L2); the figure is the
fastest pass of `--repeats`, per product, in wall-clock microseconds.

usage: python benchmarks/product_threads.py [--shapes 576x1536 ...] [--rows 128 256 ...]
       [--pack-hints none 1] [--layers 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch

# The default model's (SmolLM2-135M) projections, output x input features: fused q/k/v,
# o_proj, fused gate/up, down_proj.
DEFAULT_SHAPES = ["960x576", "576x576", "3072x576", "576x1536"]


def _pass_us(x: torch.Tensor, weights: list[torch.Tensor], repeats: int) -> float:
    """The fastest of `repeats` passes over the weights, per product, in microseconds."""
    product = torch.ops.mkldnn._linear_pointwise
    for weight in weights:
        product(x, weight, None, "none", [], "")
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for weight in weights:
            product(x, weight, None, "none", [], "")
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES,
                        help="Weights as OUTxIN (default: the default model's projections).")
    parser.add_argument("--rows", nargs="+", type=int,
                        default=[64, 128, 256, 384, 512, 768, 1024, 1536, 2048])
    parser.add_argument("--pack-hints", nargs="+", default=["none"],
                        help="The batch size each weight is packed for: 'none' (as the "
                             "model packs it) or a number.")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("This torch has no oneDNN.")
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise SystemExit("oneDNN packs no bf16 weights on this CPU (it needs avx512bw/vl/dq "
                         "or avx_ne_convert): there are no bf16 products to time.")
    threads = torch.get_num_threads()
    print(f"bf16 products, {args.layers} weights per shape in turn, 1 thread against "
          f"{threads}; microseconds per product")
    print(f"{'weight':>10} {'packed for':>10} {'rows':>6} {'1 thread':>10} "
          f"{f'{threads} threads':>10} {'speedup':>8}")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for shape in args.shapes:
            out_features, in_features = (int(n) for n in shape.split("x"))
            dense = [torch.randn(out_features, in_features, generator=generator)
                     .to(torch.bfloat16) for _ in range(args.layers)]
            for hint in args.pack_hints:
                batch = None if hint == "none" else int(hint)
                weights = [torch.ops.mkldnn._reorder_linear_weight(w, batch) for w in dense]
                for rows in args.rows:
                    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
                    try:
                        torch.set_num_threads(1)
                        one = _pass_us(x, weights, args.repeats)
                    finally:
                        torch.set_num_threads(threads)
                    many = _pass_us(x, weights, args.repeats)
                    print(f"{shape:>10} {hint:>10} {rows:>6} {one:>10.1f} {many:>10.1f} "
                          f"{one / many:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
