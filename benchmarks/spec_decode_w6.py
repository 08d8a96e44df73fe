"""W6 side by side: time per output token without and with speculative decoding, measured
in one process, runs interleaved (off, n-gram, draft model, off, ...), so that on a shared
machine each pair sees the same load. W6: chats that repeat or lightly edit a ~300-token
passage (tokenserve/benchmarks/datasets.py, `grounded_edit_conversations`), 256 tokens out,
greedy, EOS ignored, batch 1 and 8 (all requests at once).

    python benchmarks/spec_decode_w6.py --rounds 3 --batches 1 8 --output-json w6.json

TPOT: a request's first to last token time over its tokens after the first, averaged over
the batch. The speedup of a mode is the median over rounds of off's TPOT / its TPOT in the
same round. The draft model defaults to the target itself (no smaller SmolLM2 here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tokenserve.benchmarks.datasets import grounded_edit_conversations
from tokenserve.entrypoints.llm import LLM
from tokenserve.model.loader import default_model_path
from tokenserve.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}


def mean_tpot_ms(outputs) -> float:
    values = []
    for output in outputs:
        metrics, count = output.metrics, len(output.outputs[0].token_ids)
        values.append((metrics.last_token_time - metrics.first_token_time) / (count - 1) * 1e3)
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--modes", nargs="+", default=["off", "ngram", "draft_model"])
    parser.add_argument("--draft-model", default=None, help="Default: the target itself.")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    specs = {
        "off": None,
        "ngram": {**NGRAM, "num_speculative_tokens": args.num_speculative_tokens},
        "draft_model": {"method": "draft_model",
                        "model": args.draft_model or default_model_path(),
                        "num_speculative_tokens": args.num_speculative_tokens},
    }
    engines = {
        mode: LLM(speculative_config=specs[mode], kv_cache_memory="1GiB",
                  max_num_seqs=max(args.batches))
        for mode in args.modes
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for llm in engines.values():  # warm-up: first-step costs (kernel loading, allocation)
        llm.chat(grounded_edit_conversations(1, seed=99), SamplingParams(max_tokens=16),
                 use_tqdm=False)
    runs = []
    for round_index in range(args.rounds):
        for batch in args.batches:
            conversations = grounded_edit_conversations(batch, seed=round_index)
            for mode, llm in engines.items():
                llm.llm_engine.reset_prefix_cache()
                before = llm.llm_engine.get_stats().spec_decoding_stats
                before = before.copy() if before is not None else None
                started = time.perf_counter()
                outputs = llm.chat(conversations, params, use_tqdm=False)
                elapsed = time.perf_counter() - started
                run = {"round": round_index, "batch": batch, "mode": mode,
                       "tpot_ms": mean_tpot_ms(outputs), "elapsed_s": elapsed,
                       "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                       "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs)}
                after = llm.llm_engine.get_stats().spec_decoding_stats
                if after is not None:
                    drafts = after.num_drafts - before.num_drafts
                    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
                    accepted = after.num_accepted_tokens - before.num_accepted_tokens
                    run["acceptance_rate"] = accepted / max(draft_tokens, 1)
                    run["mean_acceptance_length"] = 1 + accepted / max(drafts, 1)
                    run["accepted_per_pos"] = [
                        a - b for a, b in zip(after.num_accepted_tokens_per_pos,
                                              before.num_accepted_tokens_per_pos or
                                              [0] * len(after.num_accepted_tokens_per_pos))
                    ]
                runs.append(run)
                print(json.dumps(run), flush=True)
    print("\n| batch | mode | TPOT ms (median) | speedup vs off (median of rounds) | "
          "acceptance | mean acceptance length |\n|---|---|---|---|---|---|")
    for batch in args.batches:
        for mode in args.modes:
            mine = [r for r in runs if r["batch"] == batch and r["mode"] == mode]
            ratios = [
                off["tpot_ms"] / r["tpot_ms"]
                for r in mine for off in runs
                if off["mode"] == "off" and off["batch"] == batch and off["round"] == r["round"]
            ]
            accept = [r["acceptance_rate"] for r in mine if "acceptance_rate" in r]
            length = [r["mean_acceptance_length"] for r in mine if "acceptance_rate" in r]
            print(f"| {batch} | {mode} | {statistics.median(r['tpot_ms'] for r in mine):.1f} | "
                  f"{statistics.median(ratios):.2f}x | "
                  f"{statistics.mean(accept) if accept else float('nan'):.3f} | "
                  f"{statistics.mean(length) if length else float('nan'):.2f} |")
    if args.output_json:
        with open(args.output_json, "w") as file:
            json.dump(runs, file, indent=2)


if __name__ == "__main__":
    main()
