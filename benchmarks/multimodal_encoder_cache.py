"""The issue's multimodal workload on a small random LLaVA built here (no download: real VLM
weights cannot be fetched on this machine): `--requests` requests, each `--text-tokens`
random text tokens then one `--image-size`² image, `--output-tokens` out, all submitted at
once to `LLM.generate`.

Two workloads take turns `--repeats` times on one engine: "repeating" (`--distinct-images`
images, each used by requests/distinct requests in a row) and "distinct" (every request its
own image). Each turn uses fresh images and fresh text, so neither the encoder cache nor the
prefix cache carries anything over from an earlier turn; the text comes first, so the
prefix cache shares nothing inside a turn either and only the encoder cache (and the
processor's per-image cache) can tell the two workloads apart.

Figures: median seconds of a turn, output and total (prompt + output) tokens per second,
median time to first token, and the image encoder runs of the turn.

usage: python benchmarks/multimodal_encoder_cache.py [--requests 32] [--text-tokens 64]
       [--output-tokens 32] [--image-size 384] [--distinct-images 4] [--repeats 3]
       [--encoder-cache-size 2308]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch
import transformers
from PIL import Image

from tokenserve.entrypoints.llm import LLM
from tokenserve.model.loader import default_model_path, load_tokenizer, resolve_model
from tokenserve.sampling_params import SamplingParams

IMAGE_TOKEN = "<image>"
TOWER_IMAGE_SIZE = 336  # CLIP ViT-L/14-336's: 576 image tokens per image
PATCH_SIZE = 14


def build_llava(directory: str, vision_layers: int, text_layers: int, hidden: int) -> int:
    """A random LLaVA (CLIP tower, Llama LM) with SmolLM2's tokenizer; its image token id."""
    tokenizer = load_tokenizer(resolve_model(default_model_path()))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vision = transformers.CLIPVisionConfig(
        hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=vision_layers,
        num_attention_heads=hidden // 64, image_size=TOWER_IMAGE_SIZE, patch_size=PATCH_SIZE,
    )
    text = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=text_layers, num_attention_heads=hidden // 64, num_key_value_heads=1,
        max_position_embeddings=4096,
    )
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_id,
        vision_feature_select_strategy="default", vision_feature_layer=-2,
        image_seq_length=(TOWER_IMAGE_SIZE // PATCH_SIZE) ** 2,
    )
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(directory)
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": TOWER_IMAGE_SIZE},
        crop_size={"height": TOWER_IMAGE_SIZE, "width": TOWER_IMAGE_SIZE},
    )
    transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
    ).save_pretrained(directory)
    return image_token_id


def make_prompts(args, image_token_id: int, num_images: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    images = [
        Image.fromarray(rng.integers(0, 256, (args.image_size, args.image_size, 3), np.uint8))
        for _ in range(num_images)
    ]
    per_image = args.requests // num_images
    return [
        {
            "prompt_token_ids": rng.integers(1000, 40000, args.text_tokens).tolist()
            + [image_token_id],
            "multi_modal_data": {"image": images[min(i // per_image, num_images - 1)]},
        }
        for i in range(args.requests)
    ]


def encoder_runs(llm: LLM) -> int:
    (runs,) = llm.llm_engine.collective_rpc(
        lambda worker: worker.model_runner.encoder_runner.num_encoder_runs
    )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=384)
    parser.add_argument("--distinct-images", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="The engine's step budget (default: the engine's own).")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--vision-layers", type=int, default=6)
    parser.add_argument("--text-layers", type=int, default=4)
    # Four images' outputs (576 rows each, plus slack).
    parser.add_argument("--encoder-cache-size", type=int, default=2308)
    args = parser.parse_args()

    directory = tempfile.mkdtemp(prefix="tiny_llava_bench_")
    image_token_id = build_llava(directory, args.vision_layers, args.text_layers, args.hidden_size)
    llm = LLM(directory, max_model_len=2048, kv_cache_memory="1GiB",
              encoder_cache_size=args.encoder_cache_size,
              max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    warm_up = make_prompts(args, image_token_id, args.requests, seed=10_000)[:4]
    llm.generate(warm_up, params, use_tqdm=False)
    workloads = {"repeating": args.distinct_images, "distinct": args.requests}
    results: dict[str, dict[str, list[float]]] = {
        name: {"seconds": [], "ttft": [], "tokens": [], "runs": []} for name in workloads
    }
    for repeat in range(args.repeats):
        for index, (name, num_images) in enumerate(workloads.items()):
            prompts = make_prompts(args, image_token_id, num_images, seed=2 * repeat + index)
            runs_before = encoder_runs(llm)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            results[name]["seconds"].append(time.perf_counter() - start)
            results[name]["ttft"].append(
                statistics.median(o.metrics.time_to_first_token for o in outputs)
            )
            results[name]["tokens"].append(
                sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs)
            )
            results[name]["runs"].append(encoder_runs(llm) - runs_before)

    output_tokens = args.requests * args.output_tokens
    print(f"{args.requests} requests: {args.text_tokens} text tokens + one {args.image_size}² "
          f"image ({(TOWER_IMAGE_SIZE // PATCH_SIZE) ** 2} image tokens), {args.output_tokens} "
          f"out; median of {args.repeats} turns")
    print("| workload | s / turn | output tok/s | total tok/s | median TTFT s | encoder runs |")
    print("|---|---|---|---|---|---|")
    medians = {}
    for name, figures in results.items():
        seconds = statistics.median(figures["seconds"])
        medians[name] = seconds
        print(f"| {name} ({workloads[name]} images) | {seconds:.2f} | "
              f"{output_tokens / seconds:.1f} | {statistics.median(figures['tokens']) / seconds:.0f} "
              f"| {statistics.median(figures['ttft']):.2f} | {int(statistics.median(figures['runs']))} |")
    print(f"repeating / distinct throughput: {medians['distinct'] / medians['repeating']:.2f}x")


if __name__ == "__main__":
    main()
