"""Make random PEFT LoRA adapters of a Hugging Face model directory, for LoRA benchmarks.

The default model is a GGUF file; `benchmarks/export_hf.py` writes it as an HF directory
first. Each adapter targets q/k/v/o/gate/up/down with rank `--rank`; `init_lora_weights=False`
draws B at random too, so every adapter changes the outputs (peft's default B is zero).

usage: python benchmarks/make_lora_adapters.py HF_DIR OUT_DIR [--count 4] [--rank 16]
                                                              [--alpha 32]
"""

from __future__ import annotations

import argparse
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32)
    args = parser.parse_args()
    for index in range(args.count):
        base = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32)
        config = LoraConfig(
            r=args.rank, lora_alpha=args.alpha, target_modules=TARGETS, init_lora_weights=False
        )
        torch.manual_seed(index)
        model = get_peft_model(base, config)
        # peft's random B is as large as A: scaled down so the adapted model stays fluent.
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.mul_(0.01)
        path = os.path.join(args.out_dir, f"adapter{index}")
        model.save_pretrained(path)
        print(path)


if __name__ == "__main__":
    main()
