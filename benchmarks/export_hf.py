"""Write a model tokenserve loads (default: the SmolLM2 GGUF) as a Hugging Face directory.

Peers such as vLLM read Hugging Face directories, not our GGUF: this writes the weights as
tokenserve loads them (GGUF tensors dequantized, q/k rows back in HF order) into one
safetensors file, with config.json (architectures set), generation_config.json and the
tokenizer (chat template included), so that every engine runs the very same numbers.

usage: python benchmarks/export_hf.py OUT_DIR [--model PATH] [--tokenizer PATH]
                                              [--dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file

from tokenserve.model.loader import iterate_weights, load_tokenizer, resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export(model: str | None, out_dir: str, tokenizer: str | None, dtype: str) -> str:
    files = resolve_model(model)
    os.makedirs(out_dir, exist_ok=True)

    config = files.hf_config
    if not isinstance(config, transformers.PretrainedConfig):
        # A GGUF model's config (model/gguf_config.py), as transformers' own class.
        values = config.to_dict()
        config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    config.architectures = [files.architecture]  # vLLM needs the *ForCausalLM class named
    config.dtype = dtype
    config.save_pretrained(out_dir)
    _add_legacy_keys(os.path.join(out_dir, "config.json"))
    transformers.GenerationConfig.from_model_config(config).save_pretrained(out_dir)

    weights = {name: tensor.to(DTYPES[dtype]).contiguous() for name, tensor in iterate_weights(files)}
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})

    load_tokenizer(files, tokenizer).save_pretrained(out_dir)
    return out_dir


def _add_legacy_keys(config_path: str) -> None:
    """Also write `torch_dtype`, `rope_theta` and `rope_scaling`, for transformers 4 readers."""
    with open(config_path) as file:
        config = json.load(file)
    config.setdefault("torch_dtype", config.get("dtype"))
    parameters = config.get("rope_parameters") or {}
    if "rope_theta" in parameters:
        config.setdefault("rope_theta", parameters["rope_theta"])
    if parameters.get("rope_type", "default") != "default":
        config.setdefault("rope_scaling", {k: v for k, v in parameters.items() if k != "rope_theta"})
    with open(config_path, "w") as file:
        json.dump(config, file, indent=2, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="Directory to write (created if missing).")
    parser.add_argument("--model", default=None,
                        help="HF directory or .gguf file (default: SmolLM2-135M-Instruct GGUF).")
    parser.add_argument("--tokenizer", default=None,
                        help="Tokenizer directory or .gguf file, if not the model's own.")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="Dtype of the written weights.")
    args = parser.parse_args(argv)
    try:
        out_dir = export(args.model, args.out_dir, args.tokenizer, args.dtype)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
