"""The serving processes' start-up heap is frozen (core/gc_heap.py): what start-up keeps is
no longer walked by the collector, and what it left as garbage is collected first, not kept
forever."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import gc, weakref
from tokenserve.core.gc_heap import freeze_startup_heap

class Node:
    pass

kept = [Node() for _ in range(1000)]            # lives as long as the process
garbage = Node(); garbage.self = garbage         # a cycle start-up dropped
dead = weakref.ref(garbage); del garbage
frozen = freeze_startup_heap()
tracked = {id(o) for o in gc.get_objects()}
print(dead() is None, frozen >= 1000, any(id(node) in tracked for node in kept))
"""


def test_freezing_collects_first_and_leaves_the_rest_out_of_collections():
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True
    )
    collected, frozen, walked = done.stdout.split()
    assert collected == "True"  # the dropped cycle was collected before the freeze
    assert frozen == "True"
    assert walked == "False"  # the kept objects are out of the collector's generations
