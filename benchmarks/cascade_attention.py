"""Cascade attention against chunk-by-chunk attention: one layer of the CPU attention
backend (attention/torch_sdpa.py) over a step of prefill chunks that continue contexts on
one shared cached prefix (W3's shape: 64-token chunks after a 1,024-token prefix).

For each prefix length and chunk count, the two ways take turns `--repeats` times on the
same inputs; figures are the median ms per layer, and the largest difference between the
outputs. The default head shapes are the default model's (9 query heads, 3 kv heads of
64). This is what CASCADE_MIN_PREFIX_TOKENS was chosen from (docs/benchmarks/cpu-hot-path.md).

usage: python benchmarks/cascade_attention.py [--prefix-lens 256 512 768 1024 2048]
       [--chunks 2 8] [--chunk-len 64] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenserve.attention.backend import CommonAttentionMetadata
from tokenserve.attention.torch_sdpa import TorchSDPABackend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-lens", type=int, nargs="+", default=[256, 512, 768, 1024, 2048])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--chunk-len", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    # Cascade at every prefix length measured, the short ones included: this is where the
    # engine's threshold comes from.
    backends = {
        "chunk by chunk": TorchSDPABackend(cascade=False),
        "cascade": TorchSDPABackend(cascade_min_prefix_tokens=0),
    }
    print(f"{args.chunk_len}-token chunks, {torch.get_num_threads()} threads; median ms per layer")
    print(" prefix  chunks  chunk by chunk  cascade  ratio  max difference")
    for prefix_len in args.prefix_lens:
        for num_chunks in args.chunks:
            times, outputs = time_step(args, backends, prefix_len, num_chunks)
            plain, cascade = (statistics.median(times[name]) for name in backends)
            difference = (outputs["cascade"] - outputs["chunk by chunk"]).abs().max().item()
            # Microseconds: a short prefix on a fast CPU is not 0.00.
            print(f" {prefix_len:6d}  {num_chunks:6d}  {plain * 1e3:14.3f}  {cascade * 1e3:7.3f}"
                  f"  {cascade / plain:5.2f}  {difference:.1e}")


def time_step(args, backends, prefix_len: int, num_chunks: int):
    block_size, chunk_len = args.block_size, args.chunk_len
    prefix_blocks = -(-prefix_len // block_size)
    suffix_blocks = -(-chunk_len // block_size)
    prefix_len = prefix_blocks * block_size
    tables, slots, starts = [], [], [0]
    for chunk in range(num_chunks):
        own = prefix_blocks + chunk * suffix_blocks
        table = [*range(prefix_blocks), *range(own, own + suffix_blocks)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(prefix_len, prefix_len + chunk_len)]
        starts.append(starts[-1] + chunk_len)
    generator = torch.Generator().manual_seed(0)
    num_blocks = prefix_blocks + num_chunks * suffix_blocks
    shape = TorchSDPABackend().kv_cache_shape(num_blocks, block_size, args.kv_heads, args.head_dim)
    kv_cache = torch.randn(shape, generator=generator)
    num_tokens = starts[-1]
    query = torch.randn(num_tokens, args.heads, args.head_dim, generator=generator)
    key = torch.randn(num_tokens, args.kv_heads, args.head_dim, generator=generator)
    value = torch.randn(num_tokens, args.kv_heads, args.head_dim, generator=generator)
    scale = args.head_dim**-0.5
    metadata = {}
    for name, backend in backends.items():
        metadata[name] = backend.build_metadata(CommonAttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=starts,
            seq_lens=[prefix_len + chunk_len] * num_chunks, block_tables=tables,
            block_size=block_size,
        ))
    if len(metadata["cascade"].cascades) != 1:
        raise SystemExit("The cascade backend did not plan one cascade for the chunks.")
    times: dict[str, list[float]] = {name: [] for name in backends}
    outputs = {}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, backend in backends.items():
            started = time.perf_counter()
            outputs[name] = backend.forward(query, key, value, kv_cache, metadata[name], scale)
            times[name].append(time.perf_counter() - started)
    return {name: spent[1:] for name, spent in times.items()}, outputs


if __name__ == "__main__":
    main()
