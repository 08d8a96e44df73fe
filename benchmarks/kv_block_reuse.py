"""Rounds of offline generation on one engine, each with new random prompts: per round its
wall-clock time, the process's minor page faults, and how many KV blocks the block pool
handed out for the first time (blocks never written before: on CPU their pages are faulted
in by that first write, core/block_pool.py) against blocks it handed out again.

What it shows: how much new memory a workload that repeats keeps touching, and what that
costs on the host at hand (`benchmarks/first_touch.py` measures the host's price for fresh
memory alone; docs/PERFORMANCE_CPU.md).

`--idle-warm-up` first does what a server's idle engine core does before its first requests
(core/engine_core_proc.py): `products` builds the bf16 products' oneDNN primitives and
faults the KV cache in; `all` also faults in the heap a step of the budget's tokens takes
(worker/cpu_memory.py, `HeapReserve`), as the engine core does; `none` (the default, as
`LLM` runs) neither.

usage: python benchmarks/kv_block_reuse.py [--rounds 3] [--num-prompts 64]
           [--input-len 256] [--output-len 2] [--idle-warm-up none|products|all]
           [--json FILE] [engine flags as for bench throughput, e.g. --no-enable-prefix-caching]
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from tokenserve import SamplingParams
from tokenserve.benchmarks.datasets import random_token_prompts
from tokenserve.core.block_pool import BlockPool
from tokenserve.core.gc_heap import freeze_startup_heap
from tokenserve.engine.cli_args import add_engine_arguments, engine_args_from
from tokenserve.engine.llm_engine import LLMEngine
from tokenserve.worker.product_warm_up import ProductWarmUp


def idle_warm_up(engine: LLMEngine, heap: bool) -> None:
    """What the engine core's idle loop does, all of it at once: the warm-up (without its heap
    pieces unless `heap`), then the KV cache's pages."""
    core = engine.engine_core
    if heap:
        while core.warm_up():
            pass
    else:
        budget = engine.config.scheduler_config.max_num_batched_tokens

        def products(worker) -> None:
            warm_up = ProductWarmUp(worker.model_runner.model, budget)
            while warm_up.step():
                pass

        core.collective_rpc(products)
    while core.prefault_kv_cache(1.0):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=2)
    parser.add_argument("--idle-warm-up", choices=("none", "products", "all"), default="none",
                        help="Before the rounds, what an idle engine core does first.")
    parser.add_argument("--json", help="Also write the rounds' figures to this file.")
    add_engine_arguments(parser, positional_model=False)
    args = parser.parse_args()

    handed_out: list[int] = []  # every block id the pool hands out, in turn
    get_new_blocks = BlockPool.get_new_blocks

    def recorded(pool: BlockPool, num_blocks: int):
        blocks = get_new_blocks(pool, num_blocks)
        handed_out.extend(block.block_id for block in blocks)
        return blocks

    BlockPool.get_new_blocks = recorded
    engine = LLMEngine.from_engine_args(engine_args_from(args))
    # The model and engine out of the collector's walks, as in a server's engine core and
    # LLM.generate (core/gc_heap.py): else full collections land in the timed steps.
    freeze_startup_heap()
    if args.idle_warm_up != "none":
        idle_warm_up(engine, heap=args.idle_warm_up == "all")
    num_blocks = engine.config.cache_config.num_blocks
    vocab_size = engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    written: set[int] = set()
    rounds = []
    for round_index in range(args.rounds):
        prompts = random_token_prompts(args.num_prompts, args.input_len, vocab_size,
                                       seed=round_index)
        handed_out.clear()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.perf_counter()
        for index, prompt in enumerate(prompts):
            engine.add_request(f"{round_index}-{index}", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            engine.step()
        seconds = time.perf_counter() - started
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        new = len(set(handed_out) - written)
        written.update(handed_out)
        rounds.append({"round": round_index, "seconds": seconds, "minor_faults": faults,
                       "blocks_handed_out": len(handed_out), "blocks_new": new})
        print(f"round {round_index}: {seconds:.2f} s, {faults} minor page faults, "
              f"{len(handed_out)} KV blocks handed out, {new} of them never written before "
              f"({len(written)} of {num_blocks} written so far)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"num_blocks": num_blocks, "rounds": rounds}, handle, indent=1)


if __name__ == "__main__":
    main()
