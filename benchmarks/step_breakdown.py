"""Where an engine step's time goes: wall-clock timers around the parts of a step, on W1's
shapes (random prompts, all submitted at once, greedy, EOS ignored).

Runs `--skip` steps (the prefill steps come first), then times `--steps` steps and prints
each part's mean per step. The parts nest: `execute_model` holds `model_forward` (which
holds the projections and attention) and `sample` (which holds the logits projection);
`linear` counts every projection, the logits one included.

usage: python benchmarks/step_breakdown.py [--num-prompts 64] [--input-len 256]
           [--prefix-len 0] [--output-len 128] [--skip 40] [--steps 20]
           [engine flags as for bench throughput]

`--prefix-len` puts a shared prefix of that many tokens before every prompt (W3's shape).
"""

from __future__ import annotations

import argparse
import collections
import time

from tokenserve import SamplingParams
from tokenserve.benchmarks.datasets import random_token_prompts
from tokenserve.core.gc_heap import freeze_startup_heap
from tokenserve.engine.cli_args import add_engine_arguments, engine_args_from
from tokenserve.engine.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--prefix-len", type=int, default=0)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--skip", type=int, default=40, help="Steps run before timing.")
    parser.add_argument("--steps", type=int, default=20, help="Steps timed.")
    add_engine_arguments(parser, positional_model=False)
    args = parser.parse_args()

    engine = LLMEngine.from_engine_args(engine_args_from(args))
    # The model and engine out of the collector's walks, as in a server's engine core and
    # LLM.generate (core/gc_heap.py): else full collections land in the timed steps.
    freeze_startup_heap()
    totals: dict[str, float] = collections.defaultdict(float)

    def timed(owner, name: str, label: str) -> None:
        function = getattr(owner, name)

        def wrapper(*call_args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*call_args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - started

        setattr(owner, name, wrapper)

    core = engine.engine_core
    (runner,) = core.collective_rpc(lambda worker: worker.model_runner)
    timed(runner.model.linear_method, "apply", "linear")
    timed(runner.attention, "forward", "attention")
    timed(runner.attention, "build_metadata", "attention metadata")
    timed(runner, "_sample", "sample")
    timed(runner.model, "forward", "model_forward")
    timed(runner, "execute_model", "execute_model")
    timed(core.scheduler, "schedule", "schedule")
    timed(core.scheduler, "update_from_output", "update_from_output")
    timed(engine.output_processor, "process_outputs", "output processing")

    vocab_size = engine.config.model_config.vocab_size
    prompts = random_token_prompts(
        args.num_prompts, args.input_len, vocab_size, seed=0, prefix_len=args.prefix_len
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
    for _ in range(args.skip):
        engine.step()
    totals.clear()
    started = time.perf_counter()
    steps = 0
    while steps < args.steps and engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - started
    if steps == 0:
        raise SystemExit("No step left to time: lower --skip or raise --output-len.")
    print(f"{steps} steps after {args.skip}: {elapsed / steps * 1e3:.1f} ms per step")
    for label, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"  {label:20s} {seconds / steps * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
