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


_YOUNG_PROBE = """
import gc, weakref
from tokenserve.core.gc_heap import freeze_startup_heap

class Node:
    pass

gc.collect()
old = Node(); old.self = old                     # survived a full collection
gc.collect()
old_dead = weakref.ref(old); del old
young = Node(); young.self = young               # made since
young_dead = weakref.ref(young); del young
kept = [Node() for _ in range(1000)]
frozen = freeze_startup_heap(full=False)
tracked = {id(o) for o in gc.get_objects()}
print(young_dead() is None, old_dead() is not None, frozen >= 1000,
      any(id(node) in tracked for node in kept))
"""


def test_a_young_freeze_collects_only_what_was_made_since_the_last_full_collection():
    done = subprocess.run(
        [sys.executable, "-c", _YOUNG_PROBE], capture_output=True, text=True, check=True
    )
    young_collected, old_kept, frozen, walked = done.stdout.split()
    assert young_collected == "True"
    assert old_kept == "True"  # the documented cost: old garbage stays frozen
    assert frozen == "True"
    assert walked == "False"


def test_freezing_collects_first_and_leaves_the_rest_out_of_collections():
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True
    )
    collected, frozen, walked = done.stdout.split()
    assert collected == "True"  # the dropped cycle was collected before the freeze
    assert frozen == "True"
    assert walked == "False"  # the kept objects are out of the collector's generations


def test_an_offline_run_freezes_the_heap_only_while_it_runs(tiny_model_dirs, monkeypatch):
    import gc

    from tokenserve import LLM, SamplingParams

    llm = LLM(tiny_model_dirs["llama"], kv_cache_memory="64MiB")
    engine = llm.llm_engine  # built before the run, as the model is
    seen = []
    step = llm.llm_engine.step

    def watched_step():
        tracked = {id(o) for o in gc.get_objects()}
        seen.append((gc.get_freeze_count(), id(engine) in tracked))
        return step()

    monkeypatch.setattr(llm.llm_engine, "step", watched_step)
    assert gc.get_freeze_count() == 0
    llm.generate(["a b c"], SamplingParams(max_tokens=3, temperature=0.0))
    assert seen and all(count > 0 and not walked for count, walked in seen)
    assert gc.get_freeze_count() == 0  # everything handed back: nothing stays frozen

    # Objects someone else froze are left as they are (not ours to unfreeze).
    theirs = [[] for _ in range(10)]
    gc.freeze()
    try:
        llm.generate(["a b"], SamplingParams(max_tokens=2, temperature=0.0))
        assert not {id(o) for o in gc.get_objects()} & {id(o) for o in theirs}
    finally:
        gc.unfreeze()
