"""What one request's prompt step costs against its decode steps, by prompt length: the fixed
part of a step that carries a prompt (TTFT at low load, the ITL of the steps that take a
prompt) next to the per-token part.

For each prompt length, `--repeats` requests run alone, one after another (random tokens,
greedy, EOS ignored); each one's first step (its whole prompt) and second step (one decode
row) are timed, and the fastest of the repeats after the first is printed.

`--cpu-time` times the calling thread's CPU (`time.thread_time`) instead of the wall clock
(with `OMP_NUM_THREADS=1`: what a step costs, whatever else the machine runs).

usage: python benchmarks/prompt_step_cost.py [--lengths 8,16,32,64,256] [--repeats 4]
           [--cpu-time] [engine flags as for bench throughput, e.g. --quantized-max-rows 0]
"""

from __future__ import annotations

import argparse
import time

from tokenserve import SamplingParams
from tokenserve.benchmarks.datasets import random_token_prompts
from tokenserve.engine.cli_args import add_engine_arguments, engine_args_from
from tokenserve.engine.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="8,16,32,64,256")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--cpu-time", action="store_true",
                        help="The calling thread's CPU time, not wall-clock time.")
    add_engine_arguments(parser, positional_model=False)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.repeats < 2:
        raise SystemExit("--repeats must be at least 2 (the first run of each length is warm-up).")

    clock = time.thread_time if args.cpu_time else time.perf_counter

    engine = LLMEngine.from_engine_args(engine_args_from(args))
    vocab_size = engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    print("prompt tokens   prompt step ms   decode step ms")
    for length in lengths:
        prompts = random_token_prompts(args.repeats, length, vocab_size, seed=length)
        times = []
        for index, prompt in enumerate(prompts):
            engine.add_request(f"{length}-{index}", {"prompt_token_ids": prompt}, params)
            started = clock()
            engine.step()
            prompted = clock()
            engine.step()
            times.append((prompted - started, clock() - prompted))
            while engine.has_unfinished_requests():
                engine.step()
        prompt_s = min(prompt for prompt, _ in times[1:])
        decode_s = min(decode for _, decode in times[1:])
        print(f"{length:13d}   {prompt_s * 1e3:14.1f}   {decode_s * 1e3:14.1f}")


if __name__ == "__main__":
    main()
