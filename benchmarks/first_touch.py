"""How much this machine charges for memory a process writes for the first time.

A page of fresh anonymous memory (what torch.empty, malloc and the KV cache get from the
kernel) costs a fault on its first write. On bare metal that is the kernel zeroing the page,
about a microsecond; on a VM whose host takes back the memory its guests free (a balloon's
free page reporting) it can be tens of microseconds, and the same VM switches between the
two as its host's state changes (docs/PERFORMANCE_CPU.md, "How much a first touch costs").
Every KV block an engine writes for the first time pays it inside a step: W3 without prefix
caching writes ~1.6 GiB of new cache, so the host's state can move a sitting's figures as
much as a kernel change. This script measures it, to be recorded beside the figures
(benchmarks/run_side_by_side.sh does, at a sitting's start and end).

It maps `--gib` of fresh private anonymous memory and writes one byte a page, `--chunk-mib`
at a time, timing each chunk; then writes the whole mapping once more (its pages now
resident) for the cost of the write itself. Prints microseconds per page per chunk and, with
`--json`, writes them to a file.

usage: python benchmarks/first_touch.py [--gib 1] [--chunk-mib 256] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import time

import numpy as np


def touch_us_per_page(pages: np.ndarray, page_bytes: int) -> float:
    """Write one byte of every page of `pages` (a uint8 view of whole pages); microseconds
    per page."""
    started = time.perf_counter()
    pages[::page_bytes] = 1
    return (time.perf_counter() - started) / (len(pages) // page_bytes) * 1e6


def measure(total_bytes: int, chunk_bytes: int) -> dict[str, object]:
    """First writes, chunk by chunk, of a fresh mapping of total_bytes, then a second pass."""
    page_bytes = mmap.PAGESIZE
    total_bytes = max(page_bytes, total_bytes // page_bytes * page_bytes)
    chunk_bytes = max(page_bytes, min(chunk_bytes, total_bytes) // page_bytes * page_bytes)
    total_bytes = total_bytes // chunk_bytes * chunk_bytes
    region = mmap.mmap(-1, total_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        memory = np.frombuffer(region, dtype=np.uint8)
        first = [touch_us_per_page(memory[start:start + chunk_bytes], page_bytes)
                 for start in range(0, total_bytes, chunk_bytes)]
        resident = touch_us_per_page(memory, page_bytes)
        del memory
    finally:
        region.close()
    return {
        "page_bytes": page_bytes,
        "chunk_mib": chunk_bytes / 2**20,
        "first_touch_us_per_page": first,
        "first_touch_median_us_per_page": statistics.median(first),
        "resident_us_per_page": resident,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0,
                        help="Fresh memory to write (GiB; at 45 us a page, 1 GiB takes 12 s).")
    parser.add_argument("--chunk-mib", type=float, default=256,
                        help="Memory timed at a time (MiB).")
    parser.add_argument("--json", default=None, help="Also write the figures to this file.")
    args = parser.parse_args()
    if args.gib <= 0 or args.chunk_mib <= 0:
        parser.error("--gib and --chunk-mib must be positive.")
    result = measure(int(args.gib * 2**30), int(args.chunk_mib * 2**20))
    chunk_mib = result["chunk_mib"]
    print(f"Fresh anonymous memory, one byte written a page ({result['page_bytes']} B pages), "
          f"{chunk_mib:g} MiB at a time; microseconds per page:")
    print(f"{'from MiB':>9} {'us/page':>9}")
    for index, us in enumerate(result["first_touch_us_per_page"]):
        print(f"{index * chunk_mib:>9g} {us:>9.2f}")
    print(f"first write: median {result['first_touch_median_us_per_page']:.2f} us/page; "
          f"written again (resident): {result['resident_us_per_page']:.3f} us/page")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result, file, indent=2)


if __name__ == "__main__":
    main()
