"""The cost of the first request to a cold LoRA adapter, against the same request warm.

One engine (`--enable-lora`, `max_loras` = `max_cpu_loras` = the number of adapters, prefix
caching off so that every request computes its whole prompt). The first adapter warms the
operator-by-operator path adapter steps take; then, `--repeats` times, each adapter under
a fresh `lora_int_id` (so it is cold: checked in the API-side processor, its weights read,
a slot filled) runs one request, and the same request again, warm. Separately, the
worker's part alone (reading the weights and filling a slot) is timed through
`collective_rpc`. Prints the medians as JSON.

usage: python benchmarks/lora_cold_start.py NAME=PATH [NAME=PATH ...] [--model GGUF_OR_DIR]
                                            [--input-len 256] [--output-len 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

from tokenserve import LLM, LoRARequest, SamplingParams
from tokenserve.benchmarks.datasets import random_token_prompts
from tokenserve.benchmarks.throughput import lora_requests_from


def _worker_load_seconds(worker, lora_request: LoRARequest) -> float:
    manager = worker.model_runner.lora_manager
    started = time.perf_counter()
    manager.set_active_loras([lora_request], [1])
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lora_modules", nargs="+", metavar="NAME=PATH")
    parser.add_argument("--model", default=None)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    loras = lora_requests_from(args.lora_modules)
    llm = LLM(args.model, enable_lora=True, max_loras=len(loras), max_cpu_loras=len(loras),
              enable_prefix_caching=False, max_model_len=2048, kv_cache_memory="1GiB")
    vocab_size = llm.llm_engine.config.model_config.vocab_size
    [prompt] = random_token_prompts(1, args.input_len, vocab_size, 0, 0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def timed(lora) -> float:
        started = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False, lora_request=lora)
        return time.perf_counter() - started

    for lora in (None, None, loras[0], loras[0]):  # warm the engine and the adapter path
        timed(lora)
    fresh_ids = itertools.count(1000)
    cold, warm, base, worker = [], [], [], []
    for _ in range(args.repeats):
        base.append(timed(None))
        for lora in loras:
            fresh = LoRARequest(f"{lora.lora_name}-{next(fresh_ids)}", next(fresh_ids),
                                lora.lora_path)
            cold.append(timed(fresh))
            warm.append(timed(fresh))
            again = LoRARequest(fresh.lora_name + "-w", next(fresh_ids), lora.lora_path)
            worker.extend(llm.llm_engine.collective_rpc(_worker_load_seconds, (again,)))
    print(json.dumps({
        "median_cold_request_s": statistics.median(cold),
        "median_warm_request_s": statistics.median(warm),
        "median_cold_cost_s": statistics.median(c - w for c, w in zip(cold, warm)),
        "median_worker_load_and_slot_s": statistics.median(worker),
        "median_base_request_s": statistics.median(base),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "samples": len(cold),
    }))


if __name__ == "__main__":
    main()
