"""The operators outside attention in an engine step: per-step time of the RMSNorms, SwiGLU,
rotary, the embedding, the products (the oneDNN call alone and the linear method around
it; the logits' product, after the model's forward, apart as "logits"), attention, and what
is left of the model's forward.

Measures CPU time of the calling thread (`time.thread_time`), not wall-clock: run it with
`OMP_NUM_THREADS=1` and the figures are what a step costs, whatever else the machine runs
(on a shared machine a 2-thread step's wall-clock time is mostly waits for a descheduled
thread at OpenMP barriers). `--wall` measures wall-clock time instead.

usage: OMP_NUM_THREADS=1 python benchmarks/step_operators.py [--num-prompts 16]
           [--input-len 1088] [--prefix-len 0] [--output-len 2] [--skip 2] [--steps 10]
           [engine flags as for bench throughput, e.g. --max-num-batched-tokens 512]
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable

from tokenserve import SamplingParams
from tokenserve.benchmarks.datasets import random_token_prompts
from tokenserve.core.gc_heap import freeze_startup_heap
from tokenserve.engine.cli_args import add_engine_arguments, engine_args_from
from tokenserve.engine.llm_engine import LLMEngine
from tokenserve.model.layers.activation import SiluAndMul
from tokenserve.model.layers.layernorm import RMSNorm
from tokenserve.model.layers.quantization.unquantized import UnquantizedLinearMethod
from tokenserve.model.layers.rotary_embedding import RotaryEmbedding
from tokenserve.model.layers.vocab_parallel_embedding import VocabParallelEmbedding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=1088)
    parser.add_argument("--output-len", type=int, default=2)
    parser.add_argument("--prefix-len", type=int, default=0,
                        help="A shared prefix of this many tokens before every prompt (W3: 1024).")
    parser.add_argument("--skip", type=int, default=2, help="Steps run before timing.")
    parser.add_argument("--steps", type=int, default=10, help="Steps timed.")
    parser.add_argument("--wall", action="store_true", help="Wall-clock, not CPU, time.")
    add_engine_arguments(parser, positional_model=False)
    args = parser.parse_args()
    clock = time.perf_counter if args.wall else time.thread_time
    totals: dict[str, float] = collections.defaultdict(float)

    # The logits' product runs after the forward (compute_logits): timed as "logits", so
    # that "linear" and "oneDNN product" hold the forward's projections alone.
    in_logits = [False]

    def timed(function, label: str | Callable[[], str | None]):
        """`function` timed under `label` (or the label it returns at each call; None: not
        timed)."""
        def wrapper(*call_args, **kwargs):
            name = label if isinstance(label, str) else label()
            if name is None:
                return function(*call_args, **kwargs)
            started = clock()
            try:
                return function(*call_args, **kwargs)
            finally:
                totals[name] += clock() - started

        return wrapper

    # Class-level wrappers: every layer's module goes through them.
    RMSNorm.forward = timed(RMSNorm.forward, "rms_norm")
    SiluAndMul.forward = timed(SiluAndMul.forward, "silu_and_mul")
    RotaryEmbedding.forward_qkv = timed(RotaryEmbedding.forward_qkv, "rotary")
    VocabParallelEmbedding.forward = timed(VocabParallelEmbedding.forward, "embedding")
    UnquantizedLinearMethod._product = staticmethod(
        timed(UnquantizedLinearMethod._product, lambda: None if in_logits[0] else "oneDNN product")
    )

    engine = LLMEngine.from_engine_args(engine_args_from(args))
    # The model and engine out of the collector's walks, as in a server's engine core and
    # LLM.generate (core/gc_heap.py): else full collections land in the timed steps.
    freeze_startup_heap()
    (runner,) = engine.engine_core.collective_rpc(lambda worker: worker.model_runner)
    method = runner.model.linear_method

    def logits(function):
        def wrapper(*call_args, **kwargs):
            in_logits[0] = True
            try:
                return function(*call_args, **kwargs)
            finally:
                in_logits[0] = False

        return wrapper

    runner.model.compute_logits = logits(runner.model.compute_logits)
    method.apply = timed(method.apply, lambda: "logits" if in_logits[0] else "linear")
    runner.attention.forward = timed(runner.attention.forward, "attention")
    runner.model.forward = timed(runner.model.forward, "model_forward")

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
    started = clock()
    steps = 0
    while steps < args.steps and engine.has_unfinished_requests():
        engine.step()
        steps += 1
    step_time = (clock() - started) / max(steps, 1)

    def per_step(label: str) -> float:
        return totals[label] / max(steps, 1) * 1e3

    kind = "wall-clock" if args.wall else "CPU"
    print(f"{steps} steps after {args.skip}: {step_time * 1e3:.1f} ms of {kind} time per step")
    for label in sorted(totals, key=totals.get, reverse=True):
        print(f"  {label:22s} {per_step(label):8.1f} ms")
    inside = ("linear", "attention", "rms_norm", "silu_and_mul", "rotary", "embedding")
    rest = per_step("model_forward") - sum(per_step(label) for label in inside)
    print(f"  {'rest of the forward':22s} {rest:8.1f} ms")
    print(f"  {'linear minus oneDNN':22s} {per_step('linear') - per_step('oneDNN product'):8.1f} ms"
          "  (casts, padding, the GGUF block kernels)")


if __name__ == "__main__":
    main()
