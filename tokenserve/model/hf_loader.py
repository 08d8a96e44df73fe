"""Reading Hugging Face model directories: config.json, the tokenizer and *.safetensors weights.

Only local directories are read (never the Hub) and only safetensors weights are accepted:
pickled `*.bin` checkpoints can run arbitrary code when loaded.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
import transformers
from safetensors import SafetensorError, safe_open

CONFIG_FILE = "config.json"
SHARD_INDEX_FILE = "model.safetensors.index.json"


def read_architecture(model_dir: str) -> str:
    """The first entry of `architectures` in config.json, read without building a config object."""
    config_path = os.path.join(model_dir, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(
            f"Model directory {model_dir!r} has no {CONFIG_FILE}; expected a Hugging Face "
            "model directory (config.json + *.safetensors)."
        )
    try:
        with open(config_path, encoding="utf-8") as file:
            raw_config = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"Cannot read {config_path}: {error}") from error
    architectures = raw_config.get("architectures") if isinstance(raw_config, dict) else None
    if not architectures or not isinstance(architectures[0], str):
        raise ValueError(f"{config_path} does not name the model class in 'architectures'.")
    return architectures[0]


def load_hf_config(model_dir: str) -> transformers.PretrainedConfig:
    """The transformers config of a local model directory; also checks that weights exist."""
    find_weight_files(model_dir)  # fail at resolve time, not halfway through model construction
    try:
        return transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"Cannot load the config of {model_dir!r}: {error}") from error


def load_hf_tokenizer(model_dir: str) -> transformers.PreTrainedTokenizerBase:
    try:
        return transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"Cannot load a tokenizer from {model_dir!r} ({error}); "
            "pass a tokenizer directory or .gguf file explicitly."
        ) from error


def find_weight_files(model_dir: str) -> list[str]:
    """The safetensors files holding the weights, in a stable order.

    A shard index, when present, is authoritative: some repositories also ship an extra
    consolidated file with different tensor names next to the shards.
    """
    index_path = os.path.join(model_dir, SHARD_INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as file:
                weight_map = json.load(file)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"Cannot read the shard index {index_path}: {error}") from error
        paths = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        missing = [path for path in paths if not os.path.isfile(path)]
        if missing:
            raise ValueError(f"{index_path} lists shards that do not exist: {missing}")
        return paths
    paths = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if paths:
        return paths
    if glob.glob(os.path.join(model_dir, "*.bin")) or glob.glob(os.path.join(model_dir, "*.pt")):
        raise ValueError(
            f"Model directory {model_dir!r} has only PyTorch pickle weights (*.bin/*.pt); "
            "tokenserve supports only *.safetensors weights. Convert the checkpoint with "
            "transformers: model.save_pretrained(dir, safe_serialization=True)."
        )
    raise ValueError(f"Model directory {model_dir!r} contains no *.safetensors weight files.")


def iterate_hf_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of every safetensors file, in the checkpoint's dtype."""
    for path in find_weight_files(model_dir):
        yield from _iterate_safetensors_file(path)


def _iterate_safetensors_file(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        handle = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as error:
        raise ValueError(f"Weight file {path} is corrupt or truncated: {error}") from error
    with handle:
        for name in handle.keys():  # noqa: SIM118 - safe_open is not iterable
            # Older checkpoints store RoPE frequencies as a buffer; they follow from the config.
            if name.endswith("rotary_emb.inv_freq"):
                continue
            try:
                tensor = handle.get_tensor(name)
            except (SafetensorError, OSError) as error:
                raise ValueError(
                    f"Weight file {path} is corrupt: cannot read tensor {name!r}: {error}"
                ) from error
            yield name, tensor
