"""The cost of the first request to a cold LoRA adapter, against the same request warm.

One engine (`--enable-lora --max-loras N --max-cpu-loras N`, prefix caching off so that
every request computes its whole prompt); for each adapter in turn: one request while the
adapter is cold (never loaded: the API-side check of its files, reading its weights,
filling a slot), then the same request again, warm. A base-model request is timed the same
way. Prints each pair and the median cold − warm difference.

usage: python benchmarks/lora_cold_start.py NAME=PATH [NAME=PATH ...] [--model GGUF_OR_DIR]
                                            [--input-len 256] [--output-len 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tokenserve import LLM, SamplingParams
from tokenserve.benchmarks.datasets import random_token_prompts
from tokenserve.benchmarks.throughput import lora_requests_from


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lora_modules", nargs="+", metavar="NAME=PATH")
    parser.add_argument("--model", default=None)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=16)
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

    timed(None)  # warm the engine itself (kernels, allocations)
    rows = [{"adapter": None, "first_s": timed(None), "again_s": timed(None)}]
    for lora in loras:
        rows.append({"adapter": lora.lora_name, "first_s": timed(lora), "again_s": timed(lora)})
    for row in rows:
        row["cold_cost_s"] = row["first_s"] - row["again_s"]
        print(json.dumps(row))
    cold = [row["cold_cost_s"] for row in rows[1:]]
    warm_lora = statistics.median(row["again_s"] for row in rows[1:])
    print(json.dumps({
        "median_cold_cost_s": statistics.median(cold),
        "median_warm_adapter_request_s": warm_lora,
        "base_request_s": rows[0]["again_s"],
        "input_len": args.input_len,
        "output_len": args.output_len,
    }))


if __name__ == "__main__":
    main()
