"""Where an engine-core process computes: the CPU cores it is pinned to and its torch threads.

Data-parallel engine cores (engine/dp_client.py) each get their own cores, so that N
engines on N cores do not fight over them: the process and every thread it has or starts
are pinned to those cores, and torch's intra-op pool gets one thread per core.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)


def pin_to_cpus(cpu_ids: Sequence[int]) -> None:
    """Pin this process (all its threads; later ones inherit it) and size torch's threads."""
    cpus = set(cpu_ids)
    if not cpus:
        raise ValueError("An engine core needs at least one CPU core.")
    # sched_setaffinity(0) pins only the calling thread; pin the threads already running too.
    for thread_id in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread_id), cpus)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            continue
    torch.set_num_threads(len(cpus))
    logger.info("Pinned to CPU cores %s, %d torch threads.", sorted(cpus), len(cpus))
