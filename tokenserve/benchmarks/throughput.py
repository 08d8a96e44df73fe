"""`tokenserve bench throughput`: offline throughput of LLM.generate on random prompts (W1),
or with `--dataset grounded-edit` on chats that repeat or lightly edit a passage (W6, for
speculative decoding: `--speculative-config`).

All prompts are submitted at once; greedy, EOS ignored, so every request generates exactly
`--output-len` tokens. Model loading is timed apart from generation. Time per output token
(TPOT) is each request's first to last token, over its tokens after the first. With
`--lora-modules` (and `--enable-lora`), request i runs with adapter i mod their number.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from tokenserve.benchmarks.datasets import grounded_edit_conversations, random_token_prompts
from tokenserve.lora.request import LoRARequest
from tokenserve.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", choices=["random", "grounded-edit"], default="random",
                       help="random: random token ids (W1); grounded-edit: chats asking to "
                            "repeat or lightly edit a ~300-token passage (W6; --input-len and "
                            "--prefix-len do not apply).")
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
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    dataset = getattr(args, "dataset", "random")
    loras = lora_requests_from(getattr(args, "lora_modules", None))
    per_prompt = [loras[i % len(loras)] for i in range(args.num_prompts)] if loras else None
    if dataset == "grounded-edit":
        conversations = grounded_edit_conversations(args.num_prompts, args.dataset_seed)
        started = time.perf_counter()
        outputs = llm.chat(conversations, params, use_tqdm=False, lora_request=per_prompt)
    else:
        prompts = random_token_prompts(
            args.num_prompts, args.input_len, vocab_size, args.dataset_seed, args.prefix_len
        )
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
        "dataset": dataset,
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
        "mean_tpot_ms": _mean_tpot_ms(outputs),
        "engine_args": dict(engine_kwargs),
    }
    spec = stats.spec_decoding_stats
    if spec is not None:
        result["spec_decode"] = {
            "num_drafts": spec.num_drafts,
            "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
            "num_accepted_tokens_per_pos": spec.num_accepted_tokens_per_pos,
            "acceptance_rate": spec.num_accepted_tokens / max(spec.num_draft_tokens, 1),
            "mean_acceptance_length": 1 + spec.num_accepted_tokens / max(spec.num_drafts, 1),
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
    if result["mean_tpot_ms"] is not None:
        print(f"Mean TPOT: {result['mean_tpot_ms']:.2f} ms")
    if spec is not None:
        print(
            f"Speculative decoding: acceptance rate "
            f"{result['spec_decode']['acceptance_rate']:.3f}, mean acceptance length "
            f"{result['spec_decode']['mean_acceptance_length']:.2f}"
        )
    if args.output_json:
        with open(args.output_json, "w") as file:
            json.dump(result, file, indent=2)
    return result


def _mean_tpot_ms(outputs: list[Any]) -> float | None:
    """Mean over requests of (last token time - first token time) / (tokens - 1), in ms."""
    values = []
    for output in outputs:
        metrics = output.metrics
        count = len(output.outputs[0].token_ids)
        if metrics is None or metrics.first_token_time is None or count < 2:
            continue
        last = metrics.last_token_time or metrics.finished_time
        if last is not None:
            values.append((last - metrics.first_token_time) / (count - 1) * 1e3)
    return sum(values) / len(values) if values else None
