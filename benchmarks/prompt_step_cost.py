"""What one request's prompt step costs against its decode steps, by prompt length: the fixed
part of a step that carries a prompt (TTFT at low load, the ITL of the steps that take a
prompt) next to the per-token part.

For each prompt length, `--repeats` requests run alone, one after another (random tokens,
greedy, EOS ignored); each one's first step (its whole prompt) and second step (one decode
row) are timed, and the fastest of the repeats after the first is printed.

`--running N` keeps N requests decoding throughout (started first, 16 prompt tokens each):
their decode rows ride in every step, as in a server under load (W2), so a prompt step has
length + N rows; the `rows` column says how many it had.

`--cpu-time` times the calling thread's CPU (`time.thread_time`) instead of the wall clock
(with `OMP_NUM_THREADS=1`: what a step costs, whatever else the machine runs).

usage: python benchmarks/prompt_step_cost.py [--lengths 8,16,32,64,256] [--repeats 4]
           [--running 0] [--cpu-time]
           [engine flags as for bench throughput, e.g. --quantized-max-rows 0]
"""

from __future__ import annotations

import argparse
import time

from tokenserve import SamplingParams
from tokenserve.benchmarks.datasets import random_token_prompts
from tokenserve.core.gc_heap import freeze_startup_heap
from tokenserve.engine.cli_args import add_engine_arguments, engine_args_from
from tokenserve.engine.llm_engine import LLMEngine

RUNNING_PROMPT_LEN = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="8,16,32,64,256")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--running", type=int, default=0,
                        help="Requests decoding beside each prompt, in every step.")
    parser.add_argument("--cpu-time", action="store_true",
                        help="The calling thread's CPU time, not wall-clock time.")
    add_engine_arguments(parser, positional_model=False)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.repeats < 2:
        raise SystemExit("--repeats must be at least 2 (the first run of each length is warm-up).")

    clock = time.thread_time if args.cpu_time else time.perf_counter

    engine = LLMEngine.from_engine_args(engine_args_from(args))
    # The model and engine out of the collector's walks, as in a server's engine core and
    # LLM.generate (core/gc_heap.py): else full collections land in the timed steps.
    freeze_startup_heap()
    vocab_size = engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    # The running requests decode until the end (their prompt and output fill the context).
    room = engine.config.model_config.max_model_len - RUNNING_PROMPT_LEN
    running = [f"running-{index}" for index in range(args.running)]
    for request_id, prompt in zip(
        running, random_token_prompts(args.running, RUNNING_PROMPT_LEN, vocab_size, seed=1)
    ):
        running_params = SamplingParams(temperature=0.0, max_tokens=room, ignore_eos=True)
        engine.add_request(request_id, {"prompt_token_ids": prompt}, running_params)
    if running:
        engine.step()  # their prompts: from here on they decode
    print("prompt tokens   rows   prompt step ms   decode step ms")
    for length in lengths:
        prompts = random_token_prompts(args.repeats, length, vocab_size, seed=length)
        times = []
        for index, prompt in enumerate(prompts):
            request_id = f"{length}-{index}"
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            started = clock()
            engine.step()
            prompted = clock()
            # The rows of the prompt step: the prompt's, and one per request decoding beside it.
            rows = length + engine.get_stats().num_running_reqs - 1
            finished = _finished(engine.step(), request_id)  # its decode step, the last
            times.append((prompted - started, clock() - prompted))
            while not finished:
                finished = _finished(engine.step(), request_id)
        prompt_s = min(prompt for prompt, _ in times[1:])
        decode_s = min(decode for _, decode in times[1:])
        print(f"{length:13d}   {rows:4d}   {prompt_s * 1e3:14.1f}   {decode_s * 1e3:14.1f}")
    engine.abort_request(running)


def _finished(outputs: list, request_id: str) -> bool:
    return any(output.request_id == request_id and output.finished for output in outputs)


if __name__ == "__main__":
    main()
