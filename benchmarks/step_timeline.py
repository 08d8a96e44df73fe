"""How the scheduler composes the steps of a workload, and what each costs: every engine step
of a run, with its decode rows (rows of one token), its prompt tokens (chunks of more), the
requests it admitted and the first tokens it made, its wall time and the time since the run
began; then the percentiles of the time to first token.

All requests are submitted at once, as W1 and the offline `LLM.generate` do (random token
prompts, greedy, EOS ignored), so the timeline shows which requests the budget admits each
step and where a percentile of the TTFT falls: for W3's shape (`--prefix-len 1024
--input-len 64 --output-len 32`) the first step takes the shared prefix with as many
requests as the budget leaves room for (a request admitted in the step that computes the
prefix reads it from the same blocks), and the first tokens come in groups, one per step
that completes prompts: a percentile of the TTFT is one group's step, or between two.

usage: python benchmarks/step_timeline.py [--num-prompts 64] [--input-len 64]
           [--prefix-len 1024] [--output-len 32] [--steps 20]
           [engine flags as for bench throughput, e.g. --max-num-batched-tokens 1024]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tokenserve import SamplingParams
from tokenserve.benchmarks.datasets import random_token_prompts
from tokenserve.core.gc_heap import freeze_startup_heap
from tokenserve.engine.cli_args import add_engine_arguments, engine_args_from
from tokenserve.engine.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024,
                        help="A shared prefix of this many tokens before every prompt.")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20,
                        help="Steps printed (the run goes on to its end).")
    add_engine_arguments(parser, positional_model=False)
    args = parser.parse_args()

    engine = LLMEngine.from_engine_args(engine_args_from(args))
    # As in a server's engine core and LLM.generate (core/gc_heap.py).
    freeze_startup_heap()
    scheduler = engine.engine_core.scheduler
    schedule = scheduler.schedule
    outputs = []

    def recorded():
        output = schedule()
        outputs.append(output)
        return output

    scheduler.schedule = recorded
    vocab_size = engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # A warm-up request first (its own tokens, nothing shared with the run's prompts).
    warm_up = random_token_prompts(1, args.input_len, vocab_size, seed=1)[0]
    engine.add_request("warm-up", {"prompt_token_ids": warm_up},
                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    outputs.clear()

    prompts = random_token_prompts(
        args.num_prompts, args.input_len, vocab_size, seed=0, prefix_len=args.prefix_len
    )
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
    first_token: dict[str, float] = {}
    print(f"{'step':>4s} {'ends s':>7s} {'ms':>7s} {'decode':>6s} {'prompt':>6s} "
          f"{'admitted':>8s} {'first tokens':>12s}")
    step = 0
    while engine.has_unfinished_requests():
        begun = time.perf_counter()
        step_outputs = engine.step()
        ended = time.perf_counter()
        if not outputs:
            continue
        output = outputs.pop()
        scheduled = output.num_scheduled_tokens
        firsts = 0
        for request_output in step_outputs:
            request_id = request_output.request_id
            if request_id not in first_token and request_output.outputs[0].token_ids:
                first_token[request_id] = ended - started
                firsts += 1
        if step < args.steps:
            decode = sum(1 for n in scheduled.values() if n == 1)
            prompt = sum(n for n in scheduled.values() if n > 1)
            admitted = len(output.scheduled_new_reqs)
            print(f"{step:4d} {ended - started:7.3f} {(ended - begun) * 1e3:7.1f} {decode:6d} "
                  f"{prompt:6d} {admitted:8d} {firsts:12d}")
        step += 1
    ttft = np.array(list(first_token.values()))
    print(f"{step} steps in {time.perf_counter() - started:.2f} s; TTFT s: "
          f"mean {ttft.mean():.3f}, p50 {np.percentile(ttft, 50):.3f}, "
          f"p99 {np.percentile(ttft, 99):.3f}")


if __name__ == "__main__":
    main()
