"""The paged decode kernel (kernels/csrc/paged_attention.c) over a model's worth of layers,
with each row's blocks in order and scattered through the cache, for each cache dtype and
each instruction-set level the CPU runs (kernels/cpu_isa.py; lower ones forced).

A fresh engine hands out blocks nearly in order; a server that has run for a while hands
out whatever was freed last, so a row's blocks lie anywhere. The shapes default to the
default model's (9 query heads, 3 kv heads, head size 64, 30 layers) at W1's decode
(64 rows, ~340 tokens of context). Figures are ms per step (all layers): the fastest
wall-clock time of `--repeats`, the block orders, dtypes and levels taking turns; the K/V
bytes read per second; and the process's CPU time per step, which on a shared machine
moves less with the load than the wall clock (with one thread they agree when idle).
A bfloat16 cache runs twice on a level with native bf16: read in float32 arithmetic, and
with bf16 numerics ("bfloat16 dp": the dot-product path a bf16 model's decode rows take).
`--prefetch` names how the threads keep memory busy (paged_attention.DECODE_PREFETCH; the
engine takes the CPU's plan, `decode_prefetch()`); several plans take turns case by case.
`--other-csrc DIR` builds another tree's kernel (its tokenserve/kernels/csrc) beside this
one's and times it in turns with it, case by case ("other" after the level); the two
builds' outputs (of the last layer, from the warm-up) are compared bit for bit.
The bytes per second are also stated against what the machine reads at all: `torch.sum`
over a 512 MiB float32 tensor on the same threads, fastest of `--repeats`, timed between
the cases' turns.

usage: python benchmarks/paged_decode.py [--rows 64] [--context 340] [--block-size 16]
       [--layers 30] [--kv-cache-dtype float32 bfloat16 float8_e4m3fn float8_e5m2]
       [--cpu-isa avx2 avx512 ...]
       [--prefetch stream_next_item own_tokens_ahead] [--repeats 7] [--other-csrc DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from tokenserve.kernels import build, cpu_isa, paged_attention

# Bytes of the reference read (see the module docstring).
READ_BYTES = 512 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--context", type=int, default=340)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--kv-cache-dtype", nargs="+",
                        choices=["float32", "bfloat16", "float8_e4m3fn", "float8_e5m2"],
                        default=["float32", "bfloat16"])
    parser.add_argument("--cpu-isa", nargs="+", default=cpu_isa.supported_levels(),
                        help="Levels to run (default: every one this CPU runs).")
    parser.add_argument("--prefetch", nargs="+", choices=list(paged_attention.DECODE_PREFETCH),
                        default=[paged_attention.decode_prefetch()],
                        help="How the threads prefetch (default: this CPU's plan); several "
                             "take turns.")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--other-csrc", default=None,
                        help="Another tree's tokenserve/kernels/csrc, timed in turns.")
    args = parser.parse_args()
    levels = [cpu_isa.resolve(level) for level in args.cpu_isa]
    trees = ["", " other"] if args.other_csrc else [""]
    kernels = {(level, ""): paged_attention.load(level) for level in levels}
    if any(ops is None for ops in kernels.values()):
        raise SystemExit("The C kernels are unavailable (see the warning above).")
    for level in levels if args.other_csrc else []:
        library = build.build("paged_attention", level, source_dir=args.other_csrc)
        kernels[level, " other"] = paged_attention.PagedAttentionOps(ctypes.CDLL(library))

    blocks_per_row = -(-args.context // args.block_size)
    num_blocks = args.rows * blocks_per_row
    shape = (num_blocks, args.kv_heads, args.block_size, args.head_dim)
    floats = [(torch.randn(shape), torch.randn(shape)) for _ in range(args.layers)]
    caches = {
        name: [(k.to(getattr(torch, name)), v.to(getattr(torch, name))) for k, v in floats]
        for name in args.kv_cache_dtype
    }
    del floats
    generator = torch.Generator().manual_seed(0)
    tables = {
        "in order": torch.arange(num_blocks).view(args.rows, blocks_per_row),
        "scattered": torch.randperm(num_blocks, generator=generator).view(
            args.rows, blocks_per_row
        ),
    }
    query = torch.randn(args.rows, args.heads, args.head_dim)
    out = torch.empty_like(query)
    rows = torch.arange(args.rows)
    seq_lens = torch.full((args.rows,), args.context, dtype=torch.int64)
    scale = args.head_dim**-0.5
    # A bfloat16 cache also read with bf16 numerics (the dot-product path) where the level
    # has native bf16: "bfloat16 dp".
    modes = [(dtype, False) for dtype in caches]
    if "bfloat16" in caches:
        modes.insert(modes.index(("bfloat16", False)) + 1, ("bfloat16", True))
    cases = [(level, dtype, dp, order, plan, tree) for level in levels for dtype, dp in modes
             for order in tables for plan in args.prefetch for tree in trees
             if not dp or cpu_isa.native_bf16(level)]
    outputs = {}

    def step(case: tuple[str, str, bool, str, str, str]) -> None:
        level, dtype, dp, order, plan, tree = case
        for key_cache, value_cache in caches[dtype]:
            kernels[level, tree].decode(out, query, rows, key_cache, value_cache,
                                        tables[order], seq_lens, scale, bf16_numerics=dp,
                                        prefetch=plan)

    wall = dict.fromkeys(cases, float("inf"))
    cpu = dict.fromkeys(cases, float("inf"))
    # The machine's read rate: a tensor far larger than any cache, summed.
    stream = torch.ones(READ_BYTES // 4)
    read = float("inf")
    for case in cases:
        step(case)  # warm-up; its last layer's output kept, to compare the builds' bits
        outputs[case] = out.clone()
    stream.sum()
    for _ in range(args.repeats):
        for case in cases:
            started, started_cpu = time.perf_counter(), time.process_time()
            step(case)
            wall[case] = min(wall[case], time.perf_counter() - started)
            cpu[case] = min(cpu[case], time.process_time() - started_cpu)
        started = time.perf_counter()
        stream.sum()
        read = min(read, time.perf_counter() - started)
    read_rate = READ_BYTES / read / 1e9
    print(
        f"{args.rows} rows x {args.context} tokens, {args.heads} heads / {args.kv_heads} kv "
        f"heads x {args.head_dim}, block size {args.block_size}, {args.layers} layers, "
        f"{torch.get_num_threads()} threads; torch.sum reads {READ_BYTES >> 20} MiB at "
        f"{read_rate:.3g} GB/s"
    )
    for case in cases:
        level, dtype, dp, order, plan, tree = case
        element = caches[dtype][0][0].element_size()
        kv_bytes = (2 * args.rows * args.context * args.kv_heads * args.head_dim * element
                    * args.layers)
        seconds = wall[case]
        rate = kv_bytes / seconds / 1e9
        name = dtype + (" dp" if dp else "")
        same = ""
        if tree:
            this = outputs[level, dtype, dp, order, plan, ""]
            same = "  same bits" if torch.equal(outputs[case], this) else "  bits differ"
        # Microseconds and three significant digits: a tiny shape on a fast CPU is not 0.0.
        print(
            f"  {level + tree:17s} {name:11s} blocks {order:9s} {plan:16s} "
            f"{seconds * 1e3:9.3f} ms per step  {rate:8.3g} GB/s ({rate / read_rate:4.2f} of the "
            f"read rate)  cpu {cpu[case] * 1e3:9.3f} ms{same}"
        )


if __name__ == "__main__":
    main()
