"""All-reduce latency over gloo on this machine: what tensor parallelism adds per decoder
layer (two all-reduces: after attention's o_proj and after the MLP's down_proj) and per step
(one more after the embedding, an all-gather of the logits).

Two processes (ranks), each bound to its own core as the mp executor binds them, all-reduce
float32 tensors of [rows, hidden] (hidden = the default model's 576) for each row count
(a decode step's batch, or a prefill chunk's tokens); figures are the median and p90 in
microseconds over `--repeats` calls after a warm-up, and the bandwidth they imply. Also
timed: one all-gather of [rows, vocab / 2] logits (49,152 / 2 for the default model).

usage: python benchmarks/allreduce_latency.py [--hidden 576] [--rows 1 8 32 64 256 512]
       [--vocab 49152] [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time

import torch
import torch.distributed as dist

from tokenserve.distributed.cpu_binding import bind_to_cpus, cpus_for_ranks
from tokenserve.executor.multiproc import free_port


def _time_us(function, repeats: int) -> list[float]:
    for _ in range(10):
        function()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e6)
    return times


def _rank(rank: int, cpus: list[int], init_method: str, args, results) -> None:
    bind_to_cpus(cpus)
    dist.init_process_group("gloo", init_method=init_method, world_size=2, rank=rank)
    rows_figures = []
    for rows in args.rows:
        x = torch.randn(rows, args.hidden)
        reduce_us = _time_us(lambda x=x: dist.all_reduce(x), args.repeats)
        logits = torch.randn(rows, args.vocab // 2)
        parts = [torch.empty_like(logits) for _ in range(2)]
        gather_us = _time_us(
            lambda parts=parts, logits=logits: dist.all_gather(parts, logits),
            max(20, args.repeats // 4),
        )
        rows_figures.append({
            "rows": rows,
            "bytes": x.numel() * 4,
            "all_reduce_median_us": statistics.median(reduce_us),
            "all_reduce_p90_us": statistics.quantiles(reduce_us, n=10)[-1],
            "all_gather_logits_median_us": statistics.median(gather_us),
        })
    if rank == 0:
        results.put(rows_figures)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256, 512])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    cpus = cpus_for_ranks(2)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    processes = [
        context.Process(target=_rank, args=(rank, cpus[rank], init_method, args, results))
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    figures = results.get()
    for process in processes:
        process.join()
    print(f"gloo, 2 ranks on cores {cpus}, hidden {args.hidden}, float32")
    print(f"{'rows':>6} {'bytes':>9} {'all-reduce median us':>21} {'p90 us':>8} {'GB/s':>6} "
          f"{'all-gather logits us':>21}")
    for row in figures:
        bandwidth = row["bytes"] / row["all_reduce_median_us"] / 1e3
        print(f"{row['rows']:>6} {row['bytes']:>9} {row['all_reduce_median_us']:>21.1f} "
              f"{row['all_reduce_p90_us']:>8.1f} {bandwidth:>6.2f} "
              f"{row['all_gather_logits_median_us']:>21.1f}")
    if args.output_json:
        with open(args.output_json, "w") as file:
            json.dump(figures, file, indent=1)


if __name__ == "__main__":
    main()
