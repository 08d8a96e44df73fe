"""Every projection of a model plus its logits matrix, at a few row counts, on both paths:
GGUF's blocks through kernels/csrc/quant_linear.c, and oneDNN's prepacked float32 GEMM.

This is how `model/quantized.py`'s row limit was chosen: the weights stream from memory,
as in a decode step (one pass over all layers reads the whole model), so the figures are
per pass over the model, in wall-clock ms, the mean of `--repeats` passes.

usage: python benchmarks/quantized_linear.py [--model GGUF] [--rows 1 4 8 16 24 32 64]
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenserve import LLM
from tokenserve.model.linear import linear
from tokenserve.model.llama import _PROJECTIONS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="A GGUF file (default: the default model).")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 24, 32, 64])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    llm = LLM(args.model, kv_cache_memory="64MiB")
    model = llm.llm_engine.engine_core.model_runner.model
    weights = [
        (layer.packed[name], layer.quantized[name])
        for layer in model.layers
        for name in _PROJECTIONS
        if name in layer.packed and name in layer.quantized
    ]
    if model.packed_logits is not None and model.quantized_logits is not None:
        weights.append((model.packed_logits, model.quantized_logits))
    if not weights:
        raise SystemExit("This model has no weights in a quantized block form (is it a GGUF?).")
    print(f"{len(weights)} weights; ms per pass over all of them (wall clock)")
    print(f"{'rows':>5} {'quantized':>10} {'oneDNN':>10} {'oneDNN / quantized':>19}")
    for rows in args.rows:
        inputs = {width: torch.randn(rows, width) for width in {q.shape[1] for _, q in weights}}

        def quantized_pass() -> None:
            for _, quantized in weights:
                quantized.matmul(inputs[quantized.shape[1]])

        def onednn_pass() -> None:
            for packed, quantized in weights:
                linear(inputs[quantized.shape[1]], torch.empty(0), packed=packed)

        timings = [_mean_ms(function, args.repeats) for function in (quantized_pass, onednn_pass)]
        print(f"{rows:>5} {timings[0]:>10.1f} {timings[1]:>10.1f} {timings[1] / timings[0]:>19.2f}")


def _mean_ms(function, repeats: int) -> float:
    function()  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - started) / repeats * 1e3


if __name__ == "__main__":
    main()
