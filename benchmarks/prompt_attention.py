"""The prompt-attention kernel (kernels/csrc/prompt_attention.c) against the SDPA path it
replaces, on the prompt-chunk shapes of W1, W3 and W4 and short chunks, for each
instruction-set level the CPU runs with native bf16 (kernels/cpu_isa.py; lower levels keep SDPA
for bf16 chunks), or with `--kv-cache-dtype float32` for every level the CPU runs (the
kernel's float32 path, what a float32 model takes: `--dtype auto` on a CPU without native
bf16).

Both run through the CPU attention backend (attention/torch_sdpa.py) on a bf16 cache, as
`--dtype auto` serves the default model where the CPU has native bf16 (`--kv-cache-dtype`:
an 8-bit float one, as `fp8` and `fp8_e5m2` hold it; float32, with float32 attention):
one layer's forward() over a step of prompt chunks
(the K/V writes included, the same for both), with the kernel, then with the backend's
SDPA path (per chunk: the context gathered from the paged cache, a causal mask offset by
the cached tokens, PyTorch's bf16 flash kernel). Shapes default to the default model's (9
query heads, 3 kv heads, head size 64). Figures: the fastest of `--repeats` wall-clock
times (kernel and SDPA taking turns), and GFLOP/s of useful work (4 · heads · head size
per query-key pair that the causal mask lets through). With a shared prefix of at least
1,024 positions the SDPA column runs cascade attention over it, as the backend plans it; the
kernel column always the kernel (on a float32 cache the backend itself leaves such a step to
the cascade: attention/torch_sdpa.py, `prompt_kernel_takes`).

`--shared-prefix N`: the chunks' first N context positions (whole blocks) are the same
blocks in every table, as prefix caching hands W3's requests their common prefix (the
kernel's AMX path then lays those key tiles out once for consecutive chunks). `--other-csrc
DIR`: another tree's kernels (its tokenserve/kernels/csrc) built beside this one's and run
in the same turns (column `other`, and other/kernel): a before/after of a kernel change in
one process, which this machine's drift from one run to the next would swamp.

usage: python benchmarks/prompt_attention.py [--shapes w1 short w3-first w3-continue
       w3-tails w3-cached w4 w2]
       [--scale 1.0] [--block-size 16] [--cpu-isa avx512_bf16 amx] [--repeats 7]
       [--shared-prefix 0] [--other-csrc DIR] [--kv-cache-dtype bfloat16|float32|...]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import time

import torch

from tokenserve.attention.backend import CommonAttentionMetadata
from tokenserve.attention.torch_sdpa import TorchSDPABackend
from tokenserve.kernels import build, cpu_isa
from tokenserve.kernels.prompt_attention import PromptAttentionOps

# A step's prompt chunks: (query length, context length) each.
SHAPES = {
    # W1's prompt step: 8 prompts of 256 tokens, nothing cached.
    "w1": [(256, 256)] * 8,
    # Short chunks: 8 requests of 16 new tokens over 512 cached ones.
    "short": [(16, 528)] * 8,
    # W3 without prefix caching at budget 512: a 1088-token prompt's first chunk, its
    # second (continuing 512 cached tokens), and a step of the last 64 tokens of 8 prompts.
    "w3-first": [(512, 512)],
    "w3-continue": [(512, 1024)],
    "w3-tails": [(64, 1088)] * 8,
    # W3 with prefix caching: 32 requests of 64 new tokens over a cached 1024-token prefix.
    "w3-cached": [(64, 1088)] * 32,
    # W4 at budget 256: one chunk continuing a 2048-token prompt near its end.
    "w4": [(256, 2048)],
    # W2's prompt step: one 256-token prompt, nothing cached.
    "w2": [(256, 256)],
}


def _step(chunks: list[tuple[int, int]], block_size: int, args: argparse.Namespace):
    starts, seq_lens, tables, slots = [0], [], [], []
    # The whole blocks of a shared prefix are the same blocks in every chunk's table (as
    # prefix caching makes them); a chunk's own positions never fall in them.
    shared = list(range(1, 1 + args.shared_prefix // block_size))
    next_block = 1 + len(shared)
    for q_len, seq_len in chunks:
        own = min(len(shared), (seq_len - q_len) // block_size)
        count = -(-seq_len // block_size) - own
        blocks = shared[:own] + list(range(next_block, next_block + count))
        next_block += count
        starts.append(starts[-1] + q_len)
        seq_lens.append(seq_len)
        tables.append(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size
                  for p in range(seq_len - q_len, seq_len)]
    common = CommonAttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=starts, seq_lens=seq_lens,
        block_tables=tables, block_size=block_size,
    )
    tokens = starts[-1]
    qkv = torch.randn(tokens, (args.heads + 2 * args.kv_heads) * args.head_dim)
    q, k, v = qkv.split([args.heads * args.head_dim, args.kv_heads * args.head_dim,
                         args.kv_heads * args.head_dim], dim=-1)
    tensors = (q.view(tokens, args.heads, args.head_dim),
               k.view(tokens, args.kv_heads, args.head_dim),
               v.view(tokens, args.kv_heads, args.head_dim))
    return common, tensors, next_block


def _useful_flops(chunks: list[tuple[int, int]], heads: int, head_dim: int) -> float:
    pairs = sum(q_len * (seq_len - q_len) + q_len * (q_len + 1) / 2 for q_len, seq_len in chunks)
    return 4.0 * heads * head_dim * pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--scale", type=float, default=1.0,
                        help="Multiply every query and context length (a quick run: 0.1).")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--cpu-isa", nargs="+", default=None,
                        help="Levels to run (default: every one with native bf16 here; with "
                             "a float32 cache every one).")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="Context positions (whole blocks) every chunk reads from the same "
                             "blocks, as a cached prefix shared by the requests (W3: 1024).")
    parser.add_argument("--other-csrc", default=None,
                        help="Another tree's tokenserve/kernels/csrc: its kernel runs too, "
                             "taking turns with this one's (column `other`).")
    parser.add_argument("--kv-cache-dtype", default="bfloat16",
                        choices=["bfloat16", "float8_e4m3fn", "float8_e5m2", "float32"])
    args = parser.parse_args()
    cache_dtype = getattr(torch, args.kv_cache_dtype)
    float32 = cache_dtype == torch.float32
    if args.cpu_isa is None:
        args.cpu_isa = [level for level in cpu_isa.supported_levels()
                        if float32 or cpu_isa.native_bf16(level)]
    levels = [cpu_isa.resolve(level) for level in args.cpu_isa]
    print(f"{args.heads} heads / {args.kv_heads} kv heads x {args.head_dim}, block size "
          f"{args.block_size}, {args.kv_cache_dtype} cache, {torch.get_num_threads()} threads")
    if not levels:
        print("no level with native bf16 on this CPU: prompt chunks keep SDPA")
        return
    for level in levels:
        build.select_isa(level)
        backend = TorchSDPABackend(device=torch.device("cpu"), native_bf16=not float32)
        # The kernel column is the kernel's path for the level, whether or not the backend
        # takes that path on this CPU (torch_sdpa.prompt_kernel_paths).
        backend.prompt_paths = ("avx512_bf16", "amx", "float32")
        if backend.prompt_ops is None:
            raise SystemExit("The C kernels are unavailable (see the warning above).")
        builds = {"kernel": backend.prompt_ops, "sdpa": None}
        if args.other_csrc:
            library = build.build("prompt_attention", level, args.other_csrc)
            builds["other"] = PromptAttentionOps(ctypes.CDLL(library))
        for name in args.shapes:
            chunks = [(max(1, round(q * args.scale)), max(1, round(n * args.scale)))
                      for q, n in SHAPES[name]]
            chunks = [(q, max(q, n)) for q, n in chunks]
            common, tensors, num_blocks = _step(chunks, args.block_size, args)
            kv_cache = torch.randn(backend.kv_cache_shape(
                num_blocks, args.block_size, args.kv_heads, args.head_dim)).to(cache_dtype)
            metadata = backend.build_metadata(common)
            # The kernel's columns without the cascades (which it skips on its bf16 paths).
            without_cascades = dataclasses.replace(metadata, cascades=[])
            best = dict.fromkeys(builds, float("inf"))
            for _ in range(args.repeats):
                for path, ops in builds.items():
                    backend.prompt_ops = ops
                    step = metadata if ops is None else without_cascades
                    begin = time.perf_counter()
                    backend.forward(*tensors, kv_cache, step, args.head_dim**-0.5)
                    best[path] = min(best[path], time.perf_counter() - begin)
            backend.prompt_ops = builds["kernel"]
            flops = _useful_flops(chunks, args.heads, args.head_dim)
            figures = "  ".join(f"{path} {seconds * 1e3:8.2f} ms {flops / seconds / 1e9:6.1f} GFLOP/s"
                                for path, seconds in best.items())
            described = ", ".join(f"{q}/{n}" for q, n in sorted(set(chunks)))
            ratios = "".join(f"  {path}/kernel {best[path] / best['kernel']:5.2f}"
                             for path in builds if path != "kernel")
            print(f"  {level:12s} {name:12s} {len(chunks):2d} x {described:12s} {figures}"
                  f"{ratios}")


if __name__ == "__main__":
    main()
