"""`tokenserve bench throughput`: offline throughput of LLM.generate on random prompts (W1).

All prompts are submitted at once; greedy, EOS ignored, so every request generates exactly
`--output-len` tokens. Model loading is timed apart from generation. With
`--lora-modules` (and `--enable-lora`), request i runs with adapter i mod their number.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from tokenserve.benchmarks.datasets import random_token_prompts
from tokenserve.lora.request import LoRARequest
from tokenserve.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", type=int, default=64, help="Number of requests.")
    group.add_argument("--input-len", type=int, default=256,
                       help="Prompt tokens per request (after the shared prefix).")
    group.add_argument("--output-len", type=int, default=128, help="Generated tokens per request.")
    group.add_argument("--prefix-len", type=int, default=0,
                       help="Tokens of a prefix shared by all prompts.")
    group.add_argument("--dataset-seed", type=int, default=0, help="Seed of the random prompts.")
    group.add_argument("--output-json", default=None, help="Write the result here as JSON.")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories; needs --enable-lora): the requests "
                            "take them in turn.")


def lora_requests_from(values: list[str] | None) -> list[LoRARequest]:
    requests = []
    for index, value in enumerate(values or []):
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: expected NAME=PATH.")
        requests.append(LoRARequest(name, index + 1, path))
    return requests


def run(
    args: argparse.Namespace, engine_kwargs: dict[str, Any], llm_class: Callable[..., Any]
) -> dict[str, Any]:
    """Measure `llm_class(**engine_kwargs).generate` (`LLM`, which the command line passes in)."""
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1.")
    if args.prefix_len < 0:
        raise ValueError("--prefix-len must not be negative.")

    started = time.perf_counter()
    llm = llm_class(**engine_kwargs)
    load_seconds = time.perf_counter() - started
    vocab_size = llm.llm_engine.config.model_config.vocab_size
    prompts = random_token_prompts(
        args.num_prompts, args.input_len, vocab_size, args.dataset_seed, args.prefix_len
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    loras = lora_requests_from(getattr(args, "lora_modules", None))
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    started = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
        lora_request=per_prompt,
    )
    elapsed = time.perf_counter() - started

    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.llm_engine.get_stats()
    result = {
        "model": llm.llm_engine.config.model_config.model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prefix_len": args.prefix_len,
        "num_requests": len(outputs),
        "elapsed_time": elapsed,
        "load_time": load_seconds,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "total_tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "num_preemptions": stats.num_preemptions,
        "prefix_cache_hit_rate": stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
        "lora_modules": [lora.lora_name for lora in loras],
        "engine_args": dict(engine_kwargs),
    }
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['total_tokens_per_second']:.1f} total tokens/s, "
        f"{result['output_tokens_per_second']:.1f} output tokens/s "
        f"({len(outputs)} requests, {prompt_tokens} prompt + {output_tokens} output tokens "
        f"in {elapsed:.1f} s wall; model load {load_seconds:.1f} s)"
    )
    print(
        f"Preemptions: {result['num_preemptions']}; prefix cache hit rate "
        f"{result['prefix_cache_hit_rate']:.3f}"
    )
    if args.output_json:
        with open(args.output_json, "w") as file:
            json.dump(result, file, indent=2)
    return result
