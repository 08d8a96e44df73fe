"""Which CPU cores each rank's threads run on: distinct cores per rank, so that ranks do not
take each other's cores (an all-reduce waits for the slowest rank)."""

from __future__ import annotations

import os


def cpus_for_ranks(world_size: int) -> list[list[int]]:
    """This machine's usable cores split into `world_size` equal, disjoint sets.
    ValueError when there are fewer cores than ranks."""
    cpus = sorted(os.sched_getaffinity(0))
    if world_size > len(cpus):
        raise ValueError(
            f"{world_size} ranks need at least {world_size} CPU cores, one per rank; this "
            f"process may use {len(cpus)} ({cpus}). Lower tensor_parallel_size x "
            "pipeline_parallel_size, or run the ranks on several machines (ray)."
        )
    per_rank = len(cpus) // world_size
    return [cpus[r * per_rank : (r + 1) * per_rank] for r in range(world_size)]


def bind_to_cpus(cpus: list[int]) -> None:
    """Run this process on `cpus`, with as many torch threads; before any parallel region,
    so the threads created later inherit the binding."""
    import torch

    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
