"""Tests for tokenserve.model.loader: models, tokenizers and weights from HF dirs and GGUF files."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from tests.model.test_gguf_config import assert_answers_as
from tokenserve.cache_dir import CACHE_DIR_ENV
from tokenserve.model import gguf_loader
from tokenserve.model.gguf_config import LLAMA_CONFIG_DEFAULTS, GGUFLlamaConfig
from tokenserve.model.loader import (
    SUPPORTED_ARCHITECTURES,
    LoadedModelFiles,
    iterate_weights,
    load_tokenizer,
    resolve_model,
)

# Token ids transformers' own GGUF tokenizer produces for this prompt with SmolLM2.
FRANCE_PROMPT = "What is the capital of France?"
FRANCE_IDS = [1780, 314, 260, 3575, 282, 4649, 47]


@pytest.fixture(scope="module")
def default_files(default_model_path: str) -> LoadedModelFiles:
    return resolve_model(None)


@pytest.fixture(scope="module")
def transformers_gguf_checkpoint(default_files: LoadedModelFiles) -> dict:
    """transformers' own parse of the default GGUF: its config dict and dequantized HF tensors.

    This is the function `from_pretrained(dir, gguf_file=...)` uses to produce the weights it
    loads, called directly to skip building a real model (~10 s less). The meta-device model
    only supplies the HF parameter names; transformers un-permutes q/k with the head counts it
    reads from the file itself.
    """
    config = transformers.LlamaConfig.from_dict(default_files.hf_config.to_dict())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    # transformers rebuilds gguf's name table once per submodule (~10 s here); the top-level
    # pass already maps every llama parameter, so present the model without children.
    names_only = SimpleNamespace(
        config=model.config, state_dict=model.state_dict, named_children=list
    )
    return load_gguf_checkpoint(
        default_files.path, return_tensors=True, model_to_load=names_only, torch_dtype=torch.float32
    )


# --- the default GGUF model ------------------------------------------------------------------


def test_resolve_none_is_default_gguf(default_model_path: str, default_files: LoadedModelFiles):
    assert default_files.path == default_model_path
    assert default_files.format == "gguf"
    assert default_files.architecture == "LlamaForCausalLM"
    assert default_files.hf_config.architectures == ["LlamaForCausalLM"]


def test_gguf_config_matches_transformers(
    default_files: LoadedModelFiles, transformers_gguf_checkpoint: dict
):
    # The same construction AutoConfig.from_pretrained(dir, gguf_file=...) performs.
    expected = transformers.LlamaConfig.from_dict(dict(transformers_gguf_checkpoint["config"]))
    ours = default_files.hf_config
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "rope_parameters",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert getattr(ours, key) == getattr(expected, key), key


def assert_reads_as_a_llama_config(ours: GGUFLlamaConfig) -> None:
    # GGUFLlamaConfig spares the engine process transformers' imports; it must read as a
    # LlamaConfig wherever a config is read (tests/model/test_gguf_config.py).
    assert_answers_as(ours, transformers.LlamaConfig.from_dict(ours.to_dict()))


def test_gguf_config_is_a_llama_config_attribute_for_attribute(default_files: LoadedModelFiles):
    assert_reads_as_a_llama_config(default_files.hf_config)
    defaults = transformers.LlamaConfig()
    for key, value in LLAMA_CONFIG_DEFAULTS.items():
        assert getattr(defaults, key) == value, key


def test_gguf_weights_match_transformers(
    default_files: LoadedModelFiles, transformers_gguf_checkpoint: dict
):
    expected = transformers_gguf_checkpoint["tensors"]
    ours = dict(iterate_weights(default_files))
    assert sorted(ours) == sorted(expected)
    assert "lm_head.weight" not in ours  # SmolLM2 ties its embeddings
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == expected[name].shape, name
        # Not assert_close: it is slow on the 28M-element embedding and this runs 272 times.
        assert (tensor - expected[name]).abs().max().item() <= 1e-6, name


def test_gguf_tokenizer_is_cached_and_matches(
    default_files: LoadedModelFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    cache_dir = gguf_loader.tokenizer_cache_dir(default_files.path)
    assert cache_dir.startswith(str(tmp_path))
    assert not os.path.exists(cache_dir)

    converted = load_tokenizer(default_files)
    assert os.path.isfile(os.path.join(cache_dir, "tokenizer.json"))
    cached = load_tokenizer(default_files)

    assert converted(FRANCE_PROMPT).input_ids == FRANCE_IDS
    assert cached(FRANCE_PROMPT).input_ids == FRANCE_IDS
    for text in ["<|im_start|>user\nhé 12345, ok?<|im_end|>\n", "  tabs\t\tand 日本語 🙂"]:
        assert cached(text).input_ids == converted(text).input_ids
    assert cached.chat_template and cached.chat_template == converted.chat_template
    messages = [{"role": "user", "content": "hi"}]
    prompt = cached.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(prompt, str)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert (cached.eos_token, cached.bos_token) == (converted.eos_token, converted.bos_token)
    # No half-written entries are left next to the finished one.
    assert os.listdir(os.path.dirname(cache_dir)) == [os.path.basename(cache_dir)]


def test_tokenizer_cache_write_keeps_first_entry(tiny_tokenizer_dir: str, tmp_path: Path):
    # Two processes converting at once: the second rename fails and must leave the first intact.
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    cache_dir = str(tmp_path / "tokenizers" / "entry")
    gguf_loader._write_tokenizer_cache(tokenizer, cache_dir)
    first_files = sorted(os.listdir(cache_dir))
    gguf_loader._write_tokenizer_cache(tokenizer, cache_dir)
    assert sorted(os.listdir(cache_dir)) == first_files
    assert os.listdir(tmp_path / "tokenizers") == ["entry"]


# --- tiny GGUF files written here ------------------------------------------------------------


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The q/k row order llama.cpp's converter writes (pairs each head's two halves)."""
    head_dim = weight.shape[0] // num_heads
    split = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def _write_gguf(
    path: Path,
    config: transformers.PretrainedConfig,
    state_dict: dict[str, torch.Tensor],
    architecture: str = "llama",
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> str:
    """A float32 llama GGUF of `state_dict`, laid out the way llama.cpp's converter does it."""
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_uint32(f"{architecture}.block_count", config.num_hidden_layers)
    writer.add_uint32(f"{architecture}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{architecture}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{architecture}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{architecture}.attention.head_count", config.num_attention_heads)
    writer.add_uint32(f"{architecture}.attention.head_count_kv", config.num_key_value_heads)
    writer.add_float32(f"{architecture}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_float32(f"{architecture}.rope.freq_base", config.rope_parameters["rope_theta"])
    writer.add_uint32(f"{architecture}.vocab_size", config.vocab_size)
    for name, tensor in state_dict.items():
        weight = tensor.numpy()
        if ".q_proj." in name:
            weight = _llama_cpp_permute(weight, config.num_attention_heads)
        elif ".k_proj." in name:
            weight = _llama_cpp_permute(weight, config.num_key_value_heads)
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, np.ascontiguousarray(weight))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dirs: dict[str, str]) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"])


def test_gguf_round_trip_undoes_permutation_with_gqa(
    tiny_llama: transformers.PreTrainedModel, tmp_path: Path
):
    state_dict = tiny_llama.state_dict()
    path = _write_gguf(tmp_path / "tiny.gguf", tiny_llama.config, state_dict)

    files = resolve_model(path)
    assert files.hf_config.num_key_value_heads == 2
    assert files.hf_config.tie_word_embeddings is False
    assert files.hf_config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert_reads_as_a_llama_config(files.hf_config)
    ours = dict(iterate_weights(files))
    assert sorted(ours) == sorted(state_dict)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, state_dict[name], rtol=0, atol=0, msg=name)


def test_gguf_llama3_rope_freqs_become_rope_parameters(
    tiny_llama: transformers.PreTrainedModel, tmp_path: Path
):
    config = tiny_llama.config
    llama3 = {"rope_theta": 10000.0, "factor": 8.0, **gguf_loader.LLAMA3_ROPE_DEFAULTS}
    head_dim = config.hidden_size // config.num_attention_heads
    divisors = gguf_loader.llama3_frequency_divisors(llama3, head_dim).astype(np.float32)
    # All three Llama 3 bands occur: unscaled, blended and fully scaled frequencies.
    assert divisors.min() == 1.0 and divisors.max() == 8.0
    assert np.any((divisors > 1.0) & (divisors < 8.0))
    path = _write_gguf(
        tmp_path / "llama3.gguf",
        config,
        tiny_llama.state_dict(),
        extra_tensors={"rope_freqs.weight": divisors},
    )
    files = resolve_model(path)
    assert files.hf_config.rope_parameters == {"rope_type": "llama3", **llama3}
    assert_reads_as_a_llama_config(files.hf_config)
    assert "rope_freqs.weight" not in dict(iterate_weights(files))

    bad_path = _write_gguf(
        tmp_path / "custom_rope.gguf",
        config,
        tiny_llama.state_dict(),
        extra_tensors={"rope_freqs.weight": np.linspace(1, 3, head_dim // 2, dtype=np.float32)},
    )
    with pytest.raises(ValueError, match="rope_freqs"):
        resolve_model(bad_path)


def test_gguf_other_architecture_is_rejected(
    tiny_llama: transformers.PreTrainedModel, tmp_path: Path
):
    path = _write_gguf(tmp_path / "gpt2.gguf", tiny_llama.config, {}, architecture="gpt2")
    with pytest.raises(ValueError, match=r"'gpt2'.*only 'llama'"):
        resolve_model(path)


def test_truncated_gguf_header_names_the_file(default_model_path: str, tmp_path: Path):
    truncated = tmp_path / "truncated.gguf"
    with open(default_model_path, "rb") as source:
        truncated.write_bytes(source.read(1024))
    with pytest.raises(ValueError, match="truncated") as error:
        resolve_model(str(truncated))
    assert str(truncated) in str(error.value)


def test_truncated_gguf_tensor_data_names_the_file(
    tiny_llama: transformers.PreTrainedModel, tmp_path: Path
):
    # An interrupted download: metadata intact, the last tensor's bytes missing. A tiny file,
    # because parsing the default model's 49k-token vocabulary again costs seconds.
    path = Path(_write_gguf(tmp_path / "tiny.gguf", tiny_llama.config, tiny_llama.state_dict()))
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="truncated") as error:
        resolve_model(str(path))
    assert str(path) in str(error.value)


# --- Hugging Face directories ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "architecture", "config_class"),
    [
        ("llama", "LlamaForCausalLM", transformers.LlamaConfig),
        ("mistral", "MistralForCausalLM", transformers.MistralConfig),
        ("qwen2", "Qwen2ForCausalLM", transformers.Qwen2Config),
    ],
)
def test_hf_dir_weights_match_state_dict(
    tiny_model_dirs: dict[str, str],
    family: str,
    architecture: str,
    config_class: type[transformers.PretrainedConfig],
):
    files = resolve_model(tiny_model_dirs[family])
    assert (files.format, files.architecture) == ("hf", architecture)
    assert isinstance(files.hf_config, config_class)
    _assert_weights_equal_saved_model(files)


def test_hf_dir_qwen2_has_bias_and_no_lm_head(tiny_model_dirs: dict[str, str]):
    names = {name for name, _ in iterate_weights(resolve_model(tiny_model_dirs["qwen2"]))}
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert "lm_head.weight" not in names


def test_hf_dir_llama_keeps_rope_scaling(tiny_model_dirs: dict[str, str]):
    config = resolve_model(tiny_model_dirs["llama"]).hf_config
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["original_max_position_embeddings"] == 256


def test_sharded_hf_dir(tiny_model_builder: Callable[..., str], tmp_path: Path):
    model_dir = tiny_model_builder("llama", tmp_path, max_shard_size="100KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    _assert_weights_equal_saved_model(resolve_model(model_dir))


def test_hf_tokenizer(tiny_model_dirs: dict[str, str], tiny_tokenizer_dir: str):
    tokenizer = load_tokenizer(resolve_model(tiny_model_dirs["llama"]))
    reference = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    text = "Hello, world! ünïcode 🙂 <|im_end|>"
    assert tokenizer(text).input_ids == reference(text).input_ids
    assert tokenizer.chat_template == reference.chat_template
    assert tokenizer.decode(tokenizer(text).input_ids) == text


def test_explicit_tokenizer_path(tiny_model_dirs: dict[str, str], tiny_tokenizer_dir: str):
    tokenizer = load_tokenizer(resolve_model(tiny_model_dirs["qwen2"]), tiny_tokenizer_dir)
    assert tokenizer.convert_ids_to_tokens(0) == "<|endoftext|>"
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(resolve_model(tiny_model_dirs["qwen2"]), "/no/such/tokenizer")


def _assert_weights_equal_saved_model(files: LoadedModelFiles) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(files.path)
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    ours = dict(iterate_weights(files))
    assert sorted(ours) == sorted(expected)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


# --- errors ----------------------------------------------------------------------------------


def _copy_model_dir(source: str, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


def test_missing_path(tmp_path: Path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match="does not exist") as error:
        resolve_model(str(missing))
    assert str(missing) in str(error.value)


def test_dir_without_config(tmp_path: Path):
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path: Path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match=r"not a \.gguf file"):
        resolve_model(str(weights))


def test_unknown_architecture(tiny_model_dirs: dict[str, str], tmp_path: Path):
    model_dir = _copy_model_dir(tiny_model_dirs["llama"], tmp_path / "gpt2")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as error:
        resolve_model(str(model_dir))
    assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)


def test_pickle_weights_are_rejected(tiny_model_dirs: dict[str, str], tmp_path: Path):
    model_dir = _copy_model_dir(tiny_model_dirs["llama"], tmp_path / "bin")
    (model_dir / "model.safetensors").unlink()
    (model_dir / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match=r"only \*\.safetensors"):
        resolve_model(str(model_dir))


def test_truncated_safetensors_names_the_file(tiny_model_dirs: dict[str, str], tmp_path: Path):
    model_dir = _copy_model_dir(tiny_model_dirs["llama"], tmp_path / "truncated")
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    files = resolve_model(str(model_dir))
    with pytest.raises(ValueError, match="corrupt or truncated") as error:
        list(iterate_weights(files))
    assert str(weights) in str(error.value)
