"""A random model of the default model's shape whose attention heads split over 2 ranks
(8 query heads and 2 KV heads of 64 instead of SmolLM2-135M's 9 and 3), float32
safetensors with the default model's tokenizer: what docs/PARALLELISM.md compares TP=1,
TP=2 and PP=2 on, since the default model itself does not split over 2 tensor-parallel
ranks.

usage: python benchmarks/make_m0_tp_model.py OUTPUT_DIR
"""

from __future__ import annotations

import argparse

import torch
import transformers

from tokenserve.model.gguf_loader import load_gguf_config, load_gguf_tokenizer
from tokenserve.model.loader import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir")
    args = parser.parse_args()
    base = load_gguf_config(default_model_path())
    config = transformers.LlamaConfig(
        vocab_size=base.vocab_size, hidden_size=base.hidden_size,
        intermediate_size=base.intermediate_size, num_hidden_layers=base.num_hidden_layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        rms_norm_eps=base.rms_norm_eps, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, dtype="float32",
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(args.output_dir)
    load_gguf_tokenizer(default_model_path()).save_pretrained(args.output_dir)


if __name__ == "__main__":
    main()
