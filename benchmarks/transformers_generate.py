"""W1 on Hugging Face transformers `generate` (static batching): the baseline row of
docs/BENCHMARKS.md.

The same prompts as `tokenserve bench throughput` (random token ids, seed 0), on the same
weights (a HF directory written by export_hf.py), fp32, greedy, exactly `--output-len`
tokens per request (EOS ignored). Requests run in static batches of `--batch-size`;
all prompts have the same length, so there is no padding.

usage: python benchmarks/transformers_generate.py MODEL_DIR [--num-prompts 64]
           [--input-len 256] [--output-len 128] [--batch-size 64] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

from tokenserve.benchmarks.datasets import random_token_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--dataset-seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    model.eval()
    prompts = random_token_prompts(
        args.num_prompts, args.input_len, model.config.vocab_size, args.dataset_seed
    )
    output_tokens = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), args.batch_size):
            batch = torch.tensor(prompts[first : first + args.batch_size])
            generated = model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=0,
            )
            output_tokens += generated[:, batch.shape[1] :].numel()
    elapsed = time.perf_counter() - started
    prompt_tokens = args.num_prompts * args.input_len
    result = {
        "engine": f"transformers {transformers.__version__} generate",
        "num_prompts": args.num_prompts,
        "batch_size": args.batch_size,
        "elapsed_time": elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_second": args.num_prompts / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "total_tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
    }
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['total_tokens_per_second']:.1f} total tokens/s, "
        f"{result['output_tokens_per_second']:.1f} output tokens/s ({elapsed:.1f} s wall)"
    )
    if args.output_json:
        with open(args.output_json, "w") as file:
            json.dump(result, file, indent=2)


if __name__ == "__main__":
    main()
