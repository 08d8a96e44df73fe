"""Reading llama-architecture GGUF files: config from metadata, dequantized weights, tokenizer.

The config is built directly from the GGUF metadata (fast) rather than through transformers'
GGUF config path, which parses the whole vocabulary first. Weights are dequantized to float32
and renamed to Hugging Face names, undoing the q/k row permutation llama.cpp applies at
conversion time; the Q4_1 / Q8_0 ones are also given in their block form for the quantized
decode kernels (model/layers/quantization/gguf.py). The tokenizer conversion is slow, so its
result is cached on disk.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenserve.cache_dir import cache_root
from tokenserve.model.gguf_config import GGUFLlamaConfig
from tokenserve.model.gguf_file import GGUFFile, GGUFTensor

if TYPE_CHECKING:
    import torch
    import transformers
    from gguf import ReaderTensor

    from tokenserve.model.layers.quantization.gguf import QuantizedWeight
    from tokenserve.model.weight_cache import WeightDtypes

logger = logging.getLogger(__name__)

# llama-architecture GGUF files (Llama, Mistral, SmolLM, ...) all load as this HF class.
GGUF_ARCHITECTURE = "LlamaForCausalLM"
ROPE_FREQS_TENSOR = "rope_freqs.weight"
# The converted tokenizer's entry format (in its key): 2 = tokenizer_config.json carries the
# added tokens (`_record_added_tokens`).
TOKENIZER_ENTRY_FORMAT = 2

# llama.cpp only writes a rope_freqs tensor for Llama 3.x long-context RoPE; Meta released
# every such model with these parameters, so we check the tensor against them.
LLAMA3_ROPE_DEFAULTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

def load_gguf_config(path: str) -> GGUFLlamaConfig:
    """The config transformers derives from the GGUF metadata (a LlamaConfig's attributes)."""
    reader = _open_reader(path)
    architecture = _metadata(reader, "general.architecture")
    if architecture != "llama":
        raise ValueError(
            f"GGUF file {path} has architecture {architecture!r}; tokenserve loads only "
            "'llama'-architecture GGUF files (Llama, Mistral, SmolLM, ...)."
        )
    tensor_names = {tensor.name for tensor in reader.tensors}

    hidden_size = int(_required(reader, path, "llama.embedding_length"))
    num_heads = int(_required(reader, path, "llama.attention.head_count"))
    head_dim = int(_metadata(reader, "llama.attention.key_length", hidden_size // num_heads))
    rotary_dim = int(_metadata(reader, "llama.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(
            f"GGUF file {path} applies RoPE to {rotary_dim} of {head_dim} head dimensions; "
            "partial rotary embeddings are not supported."
        )
    if hidden_size % num_heads:
        raise ValueError(
            f"GGUF file {path}: the hidden size ({hidden_size}) is not a multiple of the "
            f"number of attention heads ({num_heads})."
        )
    vocab_size = _metadata(reader, "llama.vocab_size")
    if vocab_size is None:
        vocab_size = len(_required(reader, path, "tokenizer.ggml.tokens"))

    config = GGUFLlamaConfig(
        architectures=[GGUF_ARCHITECTURE],
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(_required(reader, path, "llama.feed_forward_length")),
        num_hidden_layers=int(_required(reader, path, "llama.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(_metadata(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_metadata(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_required(reader, path, "llama.context_length")),
        rope_parameters=_rope_parameters(reader, path, head_dim),
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_optional_int(_metadata(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=_optional_int(_metadata(reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=_optional_int(_metadata(reader, "tokenizer.ggml.padding_token_id")),
    )
    config.name_or_path = path
    return config


def iterate_gguf_weights(
    path: str, config: GGUFLlamaConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every weight as a float32 tensor in PyTorch [out, in] layout with its HF name."""
    reader = _open_reader(path)
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            continue  # folded into config.rope_parameters by load_gguf_config
        hf_name = _hf_name(tensor.name)
        if hf_name is None:
            raise ValueError(
                f"GGUF file {path} has tensor {tensor.name!r}, which a llama model does not "
                "have (mixture-of-experts and multimodal GGUFs are not supported)."
            )
        permute = _row_order(hf_name, config)
        yield hf_name, permute(dequantize_tensor(tensor, path))


def iterate_cached_gguf_weights(
    path: str, config: GGUFLlamaConfig, dtypes: WeightDtypes | None = None
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """`iterate_gguf_weights`, then `iterate_gguf_quantized_weights`, through the weight cache
    (model/weight_cache.py): expanded once, memory-mapped at every later load; each dense
    weight in `dtypes`' dtype for it (default float32)."""
    from tokenserve.model.weight_cache import cached_gguf_weights

    def expand() -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        yield from iterate_gguf_weights(path, config)
        yield from iterate_gguf_quantized_weights(path, config)

    return cached_gguf_weights(path, _open_reader(path).header_size, expand, dtypes)


def iterate_gguf_quantized_weights(
    path: str, config: GGUFLlamaConfig
) -> Iterator[tuple[str, QuantizedWeight]]:
    """Yield the Q4_1 and Q8_0 weights in their block form (model/layers/quantization/gguf.py),
    rows in the same order as iterate_gguf_weights gives them."""
    # The weights' modules come with the engine's load: the API process reads the config only.
    from tokenserve.model.layers.quantization.gguf import QUANTIZED_KINDS, QuantizedWeight

    reader = _open_reader(path)
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        hf_name = _hf_name(tensor.name)
        if kind not in QUANTIZED_KINDS or hf_name is None or len(tensor.shape) != 2:
            continue
        permute = _row_order(hf_name, config)
        # The file's data is [out, bytes of the row's blocks] (innermost dimension last).
        yield hf_name, QuantizedWeight.from_blocks(kind, tensor.data).map_rows(permute)


def _row_order(hf_name: str, config: GGUFLlamaConfig):
    """llama.cpp reorders q/k rows for its interleaved RoPE; we use the HF half-split RoPE."""
    if ".self_attn.q_proj." in hf_name:
        return functools.partial(_undo_rope_permutation, num_heads=config.num_attention_heads)
    if ".self_attn.k_proj." in hf_name:
        return functools.partial(_undo_rope_permutation, num_heads=config.num_key_value_heads)
    return lambda rows: rows


def load_gguf_tokenizer(path: str) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer and chat template stored in the GGUF metadata, via an on-disk cache."""
    import transformers  # here: the engine process of a GGUF model imports no transformers

    cache_dir = tokenizer_cache_dir(path)
    if os.path.isdir(cache_dir):
        return load_cached_tokenizer(cache_dir)
    directory, name = os.path.dirname(path), os.path.basename(path)
    try:
        if _converts_as_tokenizers_backend(path):
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            tokenizer = TokenizersBackend.from_pretrained(
                directory, gguf_file=name, local_files_only=True
            )
        else:
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                directory, gguf_file=name, local_files_only=True
            )
    except Exception as error:  # the GGUF parser reports corruption as assorted errors
        raise ValueError(f"Cannot read a tokenizer from GGUF file {path}: {error}") from error
    _write_tokenizer_cache(tokenizer, cache_dir)
    return tokenizer


def _converts_as_tokenizers_backend(path: str) -> bool:
    """Whether AutoTokenizer would convert this file's tokenizer with `TokenizersBackend`:
    a llama-architecture file (transformers maps no specialized tokenizer class to a llama
    or mistral config) with no tokenizer_config.json beside it (which could name another
    class). AutoTokenizer first builds the file's model config with gguf's `GGUFReader`,
    which parses every string of the vocabulary (~5 of its ~8 s on the default model, on
    the API process's path at a first start); the class then converts the tokenizer with
    transformers' own fast reader. Same tokenizer, same saved entry
    (tests/model/test_gguf_tokenizer_cache.py)."""
    if os.path.exists(os.path.join(os.path.dirname(path), "tokenizer_config.json")):
        return False
    try:
        return _metadata(_open_reader(path), "general.architecture") == "llama"
    except (OSError, ValueError):
        return False  # AutoTokenizer reports what is wrong with the file


def load_cached_tokenizer(cache_dir: str) -> transformers.PreTrainedTokenizerBase:
    """A converted tokenizer from its cache entry: through the class its tokenizer_config
    names where that is transformers' tokenizers backend (AutoTokenizer's first use indexes
    every model transformers has, ~0.5 s of the API process's start), else AutoTokenizer."""
    try:
        with open(os.path.join(cache_dir, "tokenizer_config.json"), encoding="utf-8") as file:
            name = json.load(file).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    if name in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(cache_dir, local_files_only=True)
    import transformers

    return transformers.AutoTokenizer.from_pretrained(cache_dir, local_files_only=True)


def tokenizer_cache_dir(path: str) -> str:
    """Where the converted tokenizer of a GGUF file is cached.

    The key covers the file's identity (path, size, mtime) and the transformers version that
    did the conversion, so a replaced file or an upgraded converter gets a fresh entry.
    """
    import transformers

    stat = os.stat(path)
    identity = f"{os.path.realpath(path)}|{stat.st_size}|{stat.st_mtime_ns}"
    identity += f"|{transformers.__version__}|{TOKENIZER_ENTRY_FORMAT}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(cache_root(), "tokenizers", f"{stem}-{digest}")


def _write_tokenizer_cache(tokenizer: transformers.PreTrainedTokenizerBase, cache_dir: str) -> None:
    # Save into a private temp dir and rename it into place: readers never see a partial
    # entry, and when two processes race the loser's rename fails and it discards its copy.
    parent = os.path.dirname(cache_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        partial_dir = tempfile.mkdtemp(prefix=".partial-", dir=parent)
    except OSError as error:
        logger.warning("Not caching the GGUF tokenizer in %s: %s", parent, error)
        return
    try:
        tokenizer.save_pretrained(partial_dir)
        _record_added_tokens(partial_dir)
        os.rename(partial_dir, cache_dir)
    except OSError as error:
        if not os.path.isdir(cache_dir):
            logger.warning("Not caching the GGUF tokenizer in %s: %s", cache_dir, error)
        shutil.rmtree(partial_dir, ignore_errors=True)


def _record_added_tokens(entry_dir: str) -> None:
    """Copy tokenizer.json's added tokens into tokenizer_config.json as `added_tokens_decoder`.
    Without it, transformers' from_pretrained parses the whole tokenizer.json in Python (3.5 MB
    for the default model, about half of the cached tokenizer's load, on the API process's
    path) only to read them; with it, it builds the same AddedTokens from the config. Only
    where that is the sole difference: no special_tokens_map.json or added_tokens.json, which
    the other path would also read."""
    if any(os.path.exists(os.path.join(entry_dir, name))
           for name in ("special_tokens_map.json", "added_tokens.json")):
        return
    config_path = os.path.join(entry_dir, "tokenizer_config.json")
    try:
        with open(os.path.join(entry_dir, "tokenizer.json"), encoding="utf-8") as file:
            added_tokens = json.load(file).get("added_tokens") or []
        with open(config_path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError):
        return  # the entry stays as saved: still read correctly, the slower way
    if "added_tokens_decoder" in config:
        return
    config["added_tokens_decoder"] = {str(token.pop("id")): token for token in added_tokens}
    with open(config_path, "w", encoding="utf-8") as file:
        json.dump(config, file, indent=2, ensure_ascii=False)


def _open_reader(path: str) -> GGUFFile:
    """The file's header, read once per process and shared by the config and weight
    loaders; the tensors are views of one memory map."""
    stat = os.stat(path)
    return _read_file(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _read_file(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def _metadata(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.get(key, default)


def _required(reader: GGUFFile, path: str, key: str) -> Any:
    if key not in reader.metadata:
        raise ValueError(f"GGUF file {path} lacks the metadata key {key!r}.")
    return reader.metadata[key]


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _rope_parameters(reader: GGUFFile, path: str, head_dim: int) -> dict[str, Any]:
    """transformers' `rope_parameters` from the rope.* metadata and any rope_freqs tensor."""
    theta = float(_metadata(reader, "llama.rope.freq_base", 10000.0))
    scaling_type = _metadata(reader, "llama.rope.scaling.type", "none")
    freqs_tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if freqs_tensor is not None:
        if scaling_type != "none":
            raise ValueError(
                f"GGUF file {path} has both rope scaling {scaling_type!r} and a "
                f"{ROPE_FREQS_TENSOR} tensor; this combination is not supported."
            )
        divisors = dequantize_tensor(freqs_tensor, path).numpy().astype(np.float64)
        return _llama3_rope_parameters(divisors, theta, head_dim, path)
    if scaling_type == "none":
        return {"rope_type": "default", "rope_theta": theta}
    factor = float(_required(reader, path, "llama.rope.scaling.factor"))
    if scaling_type == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    if scaling_type == "yarn":
        parameters: dict[str, Any] = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": factor,
            "original_max_position_embeddings": int(
                _required(reader, path, "llama.rope.scaling.original_context_length")
            ),
        }
        optional_keys = {
            "attention_factor": "llama.rope.scaling.attn_factor",
            "beta_fast": "llama.rope.scaling.yarn_beta_fast",
            "beta_slow": "llama.rope.scaling.yarn_beta_slow",
        }
        for hf_key, gguf_key in optional_keys.items():
            value = _metadata(reader, gguf_key)
            if value is not None:
                parameters[hf_key] = float(value)
        return parameters
    raise ValueError(f"GGUF file {path} uses unsupported rope scaling {scaling_type!r}.")


def _llama3_rope_parameters(
    divisors: np.ndarray, theta: float, head_dim: int, path: str
) -> dict[str, Any]:
    parameters: dict[str, Any] = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": float(divisors.max()),
        **LLAMA3_ROPE_DEFAULTS,
    }
    expected = llama3_frequency_divisors(parameters, head_dim)
    if expected.shape != divisors.shape or not np.allclose(expected, divisors, rtol=1e-3):
        raise ValueError(
            f"GGUF file {path} has a {ROPE_FREQS_TENSOR} tensor that does not match Llama 3 "
            "RoPE scaling; custom RoPE frequency factors are not supported."
        )
    return parameters


def llama3_frequency_divisors(parameters: dict[str, Any], head_dim: int) -> np.ndarray:
    """What llama.cpp stores in rope_freqs: the number each RoPE frequency is divided by."""
    inverse_frequencies = 1.0 / parameters["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    wavelengths = 2 * np.pi / inverse_frequencies
    original_context = parameters["original_max_position_embeddings"]
    factor = parameters["factor"]
    low, high = parameters["low_freq_factor"], parameters["high_freq_factor"]
    # Between the two cut-offs Llama 3 blends scaled and unscaled frequencies linearly.
    smooth = (original_context / wavelengths - low) / (high - low)
    divisors = 1.0 / ((1.0 - smooth) / factor + smooth)
    divisors = np.where(wavelengths < original_context / high, 1.0, divisors)
    return np.where(wavelengths > original_context / low, factor, divisors)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    layer, part, suffix = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{suffix}"


def dequantize_tensor(tensor: GGUFTensor | ReaderTensor, path: str) -> torch.Tensor:
    """A GGUF tensor as float32 in PyTorch's dimension order (ValueError for a quantization
    the gguf package cannot expand)."""
    import torch
    from gguf.quants import dequantize

    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as error:
        raise ValueError(
            f"GGUF file {path}: tensor {tensor.name!r} uses quantization "
            f"{tensor.tensor_type.name}, which the gguf package cannot dequantize."
        ) from error
    # GGUF lists dimensions innermost first; PyTorch wants [out, in].
    shape = [int(dim) for dim in reversed(tensor.shape)]
    # Unquantized tensors come back as read-only views of the memory-mapped file; copy those.
    values = np.require(values, dtype=np.float32, requirements=["C", "W"])
    return torch.from_numpy(values.reshape(shape))


def _undo_rope_permutation(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation.

    The converter stores, per head, the rows of the first and second half of the head
    interleaved (row pairs i, i + head_dim/2 become adjacent rows 2i, 2i+1), so that RoPE can
    rotate adjacent pairs. HF-style RoPE rotates the two halves, so put the halves back.
    """
    head_dim = weight.shape[0] // num_heads
    per_head = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape).contiguous()
