"""Embeddings of prompts that share a long prefix (an instruction before each query, as
Qwen3-Embedding is used): last-token pooling with prefix caching on against off, on a random
Qwen3Model built here (no download; the shape is set by the flags).

The two engines take turns `--repeats` times on the same prompts; figures are the median
seconds of one `LLM.embed` call over all prompts, the embedded tokens per second, and the
largest difference between the two engines' embeddings.

usage: python benchmarks/pooling_prefix_cache.py [--prefix-len 1024] [--query-len 32]
       [--prompts 32] [--hidden-size 512] [--layers 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers

from tokenserve.entrypoints.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--query-len", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    vocab_size = 4096
    config = transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden_size // 64,
        num_key_value_heads=max(1, args.hidden_size // 256), head_dim=64,
        max_position_embeddings=4096, architectures=["Qwen3Model"],
    )
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(1, vocab_size, (args.prefix_len,), generator=generator).tolist()
    prompts = [
        prefix + torch.randint(1, vocab_size, (args.query_len,), generator=generator).tolist()
        for _ in range(args.prompts)
    ]
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        transformers.Qwen3Model(config).save_pretrained(directory)
        tokenizer_dir = f"{directory}/tokenizer"
        _write_tokenizer(tokenizer_dir, vocab_size)
        engines = {
            caching: LLM(directory, tokenizer=tokenizer_dir, runner="pooling",
                         enable_prefix_caching=caching, kv_cache_memory="1GiB", max_num_seqs=64)
            for caching in (True, False)
        }
        seconds: dict[bool, list[float]] = {True: [], False: []}
        results = {}
        for _ in range(args.repeats):
            for caching, llm in engines.items():
                llm.llm_engine.reset_prefix_cache()
                start = time.perf_counter()
                outputs = llm.embed(prompts, use_tqdm=False)
                seconds[caching].append(time.perf_counter() - start)
                results[caching] = torch.tensor([o.outputs.embedding for o in outputs])
    tokens = sum(len(prompt) for prompt in prompts)
    print(f"{args.prompts} prompts of {args.prefix_len} shared + {args.query_len} own tokens, "
          f"Qwen3 hidden {args.hidden_size} x {args.layers} layers, fp32")
    for caching in (True, False):
        median = statistics.median(seconds[caching])
        print(f"prefix caching {'on ' if caching else 'off'}: {median:.3f} s  "
              f"({tokens / median:,.0f} tokens/s)  runs: {[round(s, 3) for s in seconds[caching]]}")
    ratio = statistics.median(seconds[False]) / statistics.median(seconds[True])
    print(f"speed-up with prefix caching: {ratio:.2f}x; largest embedding difference: "
          f"{(results[True] - results[False]).abs().max().item():.2e}")


def _write_tokenizer(directory: str, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` entries: prompts are token ids, it only names them."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), unk_token="t0",
        eos_token="t0",
    )
    tokenizer.save_pretrained(directory)


if __name__ == "__main__":
    main()
