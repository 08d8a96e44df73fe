"""Every projection of a model plus its logits matrix, at a few row counts, on three paths:
GGUF's blocks through kernels/csrc/quant_linear.c's few-row and many-row (panel) kernels,
and oneDNN's prepacked GEMM: float32, or with `--dtype bfloat16` the bf16 model's own bf16
products (rows padded as the layers pad them; AMX where the CPU has it; x handed in bf16,
in a padded row bucket, and the sums left in bf16, as the operators around a bf16 product
hand them: no cast is timed; the AMX block kernel likewise). With `--dtype
bfloat16` on the amx level the blocks' AMX kernel (csrc/quant_amx.h), on the avx512_bf16
level their vdpbf16ps kernel (csrc/quant_dp.h; its dot-product form up to DP_FEW_ROWS rows,
its panel form above, as the model routes them) instead, both with the bf16 model's
numerics, and its time beside oneDNN's for the projections and the logits apart. On the
x86-64 levels a last table sets the kernel of x rounded to 8 bits per block
(csrc/quant_i8.h) beside the block kernel the model's few-row products would take without
it, at the row counts up to `--i8-rows-up-to`.

This is how the GGUF method's row limits (model/layers/quantization/gguf.py) were chosen: the weights stream from memory,
as in a decode step (one pass over all layers reads the whole model), so the figures are
per pass over the model, in wall-clock ms: the fastest of `--repeats` passes, the paths
taking turns, so that load from other processes on the machine skews them alike and least.
The few-row kernel is timed up to `--few-rows-up-to` rows only (it is slow beyond).
With `--dtype bfloat16` the block kernel's column against oneDNN's; outside an engine
oneDNN's products run faster than within one (where its o_proj and down_proj hardly use a
second thread), so `--bf16-quantized-max-rows` follows engine steps (docs/PERFORMANCE_CPU.md,
"Two panels at a time, bf16 in and out").

usage: python benchmarks/quantized_linear.py [--model GGUF] [--rows 1 8 16 64 ...]
       [--few-rows-up-to 64] [--i8-rows-up-to 8] [--repeats 7] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from tokenserve import LLM
from tokenserve.kernels import quant_linear
from tokenserve.kernels.row_buckets import empty_rows
from tokenserve.model.layers.quantization import UnquantizedLinearMethod
from tokenserve.model.layers.quantization.gguf import AMX_MIN_ROWS, DP_FEW_ROWS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="A GGUF file (default: the default model).")
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[1, 4, 8, 16, 20, 24, 32, 48, 64, 128, 256, 512]
    )
    parser.add_argument("--few-rows-up-to", type=int, default=64)
    parser.add_argument("--i8-rows-up-to", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="The model's dtype: the oneDNN column's products (bf16 or float32).")
    args = parser.parse_args()

    llm = LLM(args.model, kv_cache_memory="64MiB", dtype=args.dtype)
    (model,) = llm.llm_engine.collective_rpc(lambda worker: worker.model_runner.model)
    # Every linear layer (the projections, then the LM head) with both forms of its weight.
    weights = [
        (module, module.blocks)
        for module in model.modules()
        if getattr(module, "blocks", None) is not None and module.packed_weight is not None
    ]
    if not weights:
        raise SystemExit("This model has no weights in a quantized block form (is it a GGUF?).")
    print(
        f"{len(weights)} weights, {args.dtype}; ms per pass over all of them (wall clock), "
        f"{torch.get_num_threads()} threads"
    )
    kernel = ("amx" if all(quantized.uses_amx for _, quantized in weights)
              else "dp" if all(quantized.uses_dp for _, quantized in weights) else None)
    head = getattr(model, "lm_head", None)
    projections = [w for w in weights if w[0] is not head]
    logits = [w for w in weights if w[0] is head]
    if kernel is not None:
        _bf16_table(kernel, projections, logits, args.rows, args.repeats)
    else:
        _float32_table(weights, args.rows, args.few_rows_up_to, args.repeats)
    ops = quant_linear.load()
    i8_rows = [rows for rows in args.rows if rows <= args.i8_rows_up_to]
    if ops is not None and ops.i8 and i8_rows:
        _i8_table(kernel or "few-row", projections, logits, i8_rows, args.repeats)


def _float32_table(weights: list, rows_list: list[int], few_rows_up_to: int,
                   repeats: int) -> None:
    """A float32 model: the float32 block kernels against oneDNN's float32 GEMM."""
    print(
        f"{'rows':>5} {'few-row':>8} {'many-row':>9} {'oneDNN':>8} "
        f"{'oneDNN / few-row':>17} {'oneDNN / many-row':>18}"
    )
    for rows in rows_list:
        inputs = {width: torch.randn(rows, width) for width in {q.shape[1] for _, q in weights}}
        paths = ["many-row", "oneDNN"] + (["few-row"] if rows <= few_rows_up_to else [])
        many, onednn, *few_or_none = _best_ms(
            [functools.partial(_pass, weights, inputs, path) for path in paths], repeats
        )
        few = few_or_none[0] if few_or_none else None
        few_cells = ("-", "-") if few is None else (f"{few:.1f}", f"{onednn / few:.2f}")
        print(
            f"{rows:>5} {few_cells[0]:>8} {many:>9.1f} {onednn:>8.1f} "
            f"{few_cells[1]:>17} {onednn / many:>18.2f}"
        )


def _bf16_table(kernel: str, projections: list, head: list, rows_list: list[int],
                repeats: int) -> None:
    """A bf16 model: the blocks' bf16 kernel (`kernel`: "amx" or "dp") against oneDNN's
    bf16 GEMM, projections and logits matrix apart (the float32 block kernels are not this
    model's numerics)."""
    weights = projections + head
    name = {"amx": "AMX", "dp": "vdpbf16ps"}[kernel]
    print("(bf16: the float32 block kernels are another model's numerics; not timed)")
    print(f"{'rows':>5} {name + ' proj':>14} {'oneDNN proj':>12} {'ratio':>6} "
          f"{name + ' logits':>16} {'oneDNN logits':>14} {'ratio':>6}")
    for rows in rows_list:
        inputs = {width: torch.randn(rows, width) for width in {q.shape[1] for _, q in weights}}
        # What each path reads in the model: oneDNN's bf16 GEMM and the AMX block kernel x
        # already rounded by the operator before (with room for oneDNN's padded rows), and
        # they hand their sums on in bf16; the vdpbf16ps kernel float32 x.
        bf16_inputs = {width: empty_rows(tuple(x.shape), torch.bfloat16).copy_(x)
                       for width, x in inputs.items()}
        groups = (projections, head)
        block_p, onednn_p, block_h, onednn_h = _best_ms(
            [functools.partial(_pass, group,
                               bf16_inputs if path in ("oneDNN", "amx") else inputs, path)
             for group in groups for path in (kernel, "oneDNN")], repeats)
        print(f"{rows:>5} {block_p:>14.1f} {onednn_p:>12.1f} {onednn_p / block_p:>6.2f} "
              f"{block_h:>16.2f} {onednn_h:>14.2f} {onednn_h / block_h:>6.2f}")
    if kernel == "dp":
        _dp_forms(projections, rows_list, repeats)


def _i8_table(kernel: str, projections: list, head: list, rows_list: list[int],
              repeats: int) -> None:
    """The kernel of x rounded to 8 bits against the block kernel the model's products of
    these rows take without it (`kernel`: "amx", below AMX_MIN_ROWS rows the float32
    few-row one; "dp"; "few-row"), each reading what it reads in the model (the AMX
    kernel bf16 x, the others float32)."""
    names = {"amx": "AMX", "dp": "vdpbf16ps", "few-row": "few-row"}
    print("x rounded to 8 bits (csrc/quant_i8.h) against the block kernel taken without it:")
    print(f"{'rows':>5} {'8-bit proj':>11} {'other proj':>11} {'ratio':>6} "
          f"{'8-bit logits':>13} {'other logits':>13} {'ratio':>6}  other")
    for rows in rows_list:
        other = "few-row" if kernel == "amx" and rows < AMX_MIN_ROWS else kernel
        inputs = {width: torch.randn(rows, width)
                  for width in {q.shape[1] for _, q in projections + head}}
        other_inputs = ({width: x.to(torch.bfloat16) for width, x in inputs.items()}
                        if other == "amx" else inputs)
        i8_p, other_p, i8_h, other_h = _best_ms(
            [functools.partial(_pass, group, inputs if path == "i8" else other_inputs, path)
             for group in (projections, head) for path in ("i8", other)], repeats)
        print(f"{rows:>5} {i8_p:>11.1f} {other_p:>11.1f} {other_p / i8_p:>6.2f} "
              f"{i8_h:>13.2f} {other_h:>13.2f} {other_h / i8_h:>6.2f}  {names[other]}")


def _dp_forms(projections: list, rows_list: list[int], repeats: int) -> None:
    """The vdpbf16ps kernel's two forms on the projections at each row count, whichever the
    model routes it to: how DP_FEW_ROWS was chosen."""
    print(f"vdpbf16ps forms, projections (DP_FEW_ROWS = {DP_FEW_ROWS}):")
    print(f"{'rows':>5} {'dot-product ms':>15} {'panel ms':>9} {'dot / panel':>12}")
    for rows in rows_list:
        inputs = {width: torch.randn(rows, width) for width in {q.shape[1] for _, q in projections}}
        dot, panel = _best_ms([functools.partial(_pass, projections, inputs, path)
                               for path in ("dp-dot", "dp-panels")], repeats)
        print(f"{rows:>5} {dot:>15.1f} {panel:>9.1f} {dot / panel:>12.2f}")


def _pass(weights: list, inputs: dict[int, torch.Tensor], path: str) -> None:
    """One product with every weight, on `path`."""
    for layer, quantized in weights:
        x = inputs[quantized.shape[1]]
        if path == "oneDNN":
            _ONEDNN.apply(layer, x)
        elif path == "amx":
            quantized.matmul(x, amx=True)
        elif path == "dp":  # its dot-product or panel form by rows, as the model routes them
            quantized.matmul(x, dp=True, panels=x.shape[0] > DP_FEW_ROWS)
        elif path == "i8":
            quantized.matmul(x, i8=True)
        elif path in ("dp-dot", "dp-panels"):
            quantized.matmul(x, dp=True, panels=path == "dp-panels")
        else:
            quantized.matmul(x, panels=path == "many-row")


# A layer's packed weight alone (a bf16 one rounds x and pads its rows, as the model does).
_ONEDNN = UnquantizedLinearMethod(use_onednn=True)


def _best_ms(functions: list[Callable[[], None]], repeats: int) -> list[float]:
    """The fastest of `repeats` calls of each function, the functions taking turns."""
    best = [float("inf")] * len(functions)
    for function in functions:
        function()  # warm-up
    for _ in range(repeats):
        for index, function in enumerate(functions):
            started = time.perf_counter()
            function()
            best[index] = min(best[index], (time.perf_counter() - started) * 1e3)
    return best


if __name__ == "__main__":
    main()
