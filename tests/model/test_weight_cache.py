"""The weight cache (tokenserve/model/weight_cache.py): a GGUF model's expanded weights,
written at the first load and memory-mapped at the next, identical to a fresh expansion;
a damaged or partial entry is never served."""

from __future__ import annotations

import gc
import itertools
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize

from tokenserve.attention.selector import get_attention_backend
from tokenserve.cache_dir import CACHE_DIR_ENV
from tokenserve.config import KernelConfig
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.model import gguf_loader, weight_cache
from tokenserve.model.layers.quantization.gguf import QuantizedWeight
from tokenserve.model.registry import get_model
from tokenserve.model.loader import (
    LoadedModelFiles,
    iterate_model_weights,
    iterate_quantized_weights,
    iterate_weights,
    resolve_model,
)

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 96
# HF name → [out, in] shape; the projections are written as Q4_1 (the logits as Q8_0).
_PROJECTIONS = {
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (HIDDEN * KV_HEADS // HEADS, HIDDEN),
    "self_attn.v_proj": (HIDDEN * KV_HEADS // HEADS, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
    "mlp.up_proj": (INTERMEDIATE, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTERMEDIATE),
}


def write_quantized_gguf(path: Path, seed: int = 0) -> str:
    """A tiny llama GGUF as llama.cpp's Q4_1 files are: Q4_1 projections, a Q8_0 output
    matrix, float32 norms and embeddings."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, LAYERS)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", LAYERS), ("context_length", 256),
                       ("embedding_length", HIDDEN), ("feed_forward_length", INTERMEDIATE),
                       ("attention.head_count", HEADS), ("attention.head_count_kv", KV_HEADS),
                       ("vocab_size", VOCAB)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)

    def add(hf_name: str, shape: tuple[int, ...], kind: gguf.GGMLQuantizationType | None) -> None:
        values = rng.standard_normal(shape).astype(np.float32)
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        if kind is None:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, quantize(values, kind), raw_dtype=kind)

    add("model.embed_tokens.weight", (VOCAB, HIDDEN), None)
    add("model.norm.weight", (HIDDEN,), None)
    add("lm_head.weight", (VOCAB, HIDDEN), gguf.GGMLQuantizationType.Q8_0)
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        add(prefix + "input_layernorm.weight", (HIDDEN,), None)
        add(prefix + "post_attention_layernorm.weight", (HIDDEN,), None)
        for module, shape in _PROJECTIONS.items():
            add(f"{prefix}{module}.weight", shape, gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv(CACHE_DIR_ENV, str(directory))
    return directory


@pytest.fixture
def files(tmp_path: Path) -> LoadedModelFiles:
    return resolve_model(write_quantized_gguf(tmp_path / "tiny-q4_1.gguf"))


def fresh_expansion(files: LoadedModelFiles) -> list:
    return list(itertools.chain(iterate_weights(files), iterate_quantized_weights(files)))


def assert_identical(ours: list, reference: list) -> None:
    assert [name for name, _ in ours] == [name for name, _ in reference]
    for (name, got), (_, expected) in zip(ours, reference, strict=True):
        if isinstance(expected, QuantizedWeight):
            assert isinstance(got, QuantizedWeight) and got.kind == expected.kind, name
            pairs = ((got.qs, expected.qs), (got.scales, expected.scales))
        else:
            pairs = ((got, expected),)
        for a, b in pairs:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


def entries(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "weights").iterdir())


def forbid_expansion(monkeypatch: pytest.MonkeyPatch) -> None:
    def expand(*args, **kwargs):
        raise AssertionError("expanded although the cache holds the weights")

    monkeypatch.setattr(gguf_loader, "iterate_gguf_weights", expand)
    monkeypatch.setattr(gguf_loader, "iterate_gguf_quantized_weights", expand)


def test_a_hit_gives_the_weights_of_a_fresh_expansion(
    files: LoadedModelFiles, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    reference = fresh_expansion(files)
    assert any(isinstance(weight, QuantizedWeight) for _, weight in reference)
    assert_identical(list(iterate_model_weights(files)), reference)  # a miss: written
    [entry] = entries(cache_dir)
    forbid_expansion(monkeypatch)
    hit = list(iterate_model_weights(files))
    assert_identical(hit, reference)
    # The tensors are writable views of the entry's private mapping, not of the file.
    hit[0][1].add_(1.0)
    assert_identical(list(iterate_model_weights(files)), reference)
    assert entries(cache_dir) == [entry]


@pytest.mark.parametrize("damage", ["flip", "truncate", "zero_tail", "empty"])
def test_a_damaged_entry_is_rebuilt_never_served(
    files: LoadedModelFiles, cache_dir: Path, damage: str, monkeypatch: pytest.MonkeyPatch
):
    reference = fresh_expansion(files)
    list(iterate_model_weights(files))
    [entry] = entries(cache_dir)
    data = bytearray(entry.read_bytes())
    if damage == "flip":
        data[len(data) // 3] ^= 0x10  # inside the arrays: only a checksum sees it
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "zero_tail":
        data[-4096:] = bytes(4096)
    else:
        data = bytearray()
    entry.write_bytes(bytes(data))
    expansions = []
    expand = gguf_loader.iterate_gguf_weights
    monkeypatch.setattr(gguf_loader, "iterate_gguf_weights",
                        lambda *args: expansions.append(args) or expand(*args))
    assert_identical(list(iterate_model_weights(files)), reference)
    assert len(expansions) == 1  # expanded again, not read from the damaged entry
    # Rebuilt: whole again, and served from now on.
    assert len(weight_cache.read_entry(str(entry))) == len(reference)


def test_another_file_or_expansion_code_gets_another_entry(
    tmp_path: Path, files: LoadedModelFiles, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    list(iterate_model_weights(files))
    # The same name, other contents: the file's identity (size, mtime, header) differs.
    other = resolve_model(write_quantized_gguf(tmp_path / "other" / "tiny-q4_1.gguf", seed=1))
    reference = fresh_expansion(other)
    assert_identical(list(iterate_model_weights(other)), reference)
    assert len(entries(cache_dir)) == 2
    # The same file expanded by other code (or another gguf / numpy): a third entry.
    monkeypatch.setattr(weight_cache, "code_version", lambda: "another expansion")
    list(iterate_model_weights(files))
    assert len(entries(cache_dir)) == 3


def test_an_interrupted_load_leaves_no_entry(files: LoadedModelFiles, cache_dir: Path):
    weights = iterate_model_weights(files)
    next(weights)
    weights.close()  # the load failed after the first weight
    assert entries(cache_dir) == []
    reference = fresh_expansion(files)
    assert_identical(list(iterate_model_weights(files)), reference)
    [entry] = entries(cache_dir)
    assert not entry.name.startswith(".partial-")


def test_an_unwritable_cache_still_loads(
    files: LoadedModelFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_DIR_ENV, str(blocker))
    assert_identical(list(iterate_model_weights(files)), fresh_expansion(files))
    assert os.path.isfile(blocker)


def mapped_file(address: int) -> str | None:
    """The file mapped at `address` in this process (None: memory no file backs)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            if start <= address < end:
                path = fields[5].strip() if len(fields) > 5 else ""
                return path if path.startswith("/") else None
    raise AssertionError(f"nothing mapped at {address:#x}")


def loaded_model(gguf: str) -> torch.nn.Module:
    """The float32 model get_model loads from the GGUF file (its weights as the cache gives
    them), unpacked."""
    model_config = EngineArgs(model=gguf, dtype="float32").create_engine_config().model_config
    backend = get_attention_backend(torch.device("cpu"), model_config.torch_dtype)
    return get_model(model_config, backend, KernelConfig(), torch.device("cpu"),
                     pack_weights=False)


def test_a_model_from_its_entry_keeps_the_mapping_as_its_parameters(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    gguf = write_quantized_gguf(tmp_path / "tiny-q4_1.gguf")
    miss = dict(loaded_model(gguf).named_parameters())  # expands and writes the entry
    [entry] = entries(cache_dir)
    written = entry.read_bytes()
    forbid_expansion(monkeypatch)
    hit = dict(loaded_model(gguf).named_parameters())
    assert any(".qkv_proj." in name for name in hit) and any(".gate_up_proj." in name for name in hit)
    # Every parameter, the merged ones' parts side by side, lies in a mapping of the entry.
    assert {mapped_file(param.data_ptr()) for param in hit.values()} == {str(entry)}
    assert {mapped_file(param.data_ptr()) for param in miss.values()} == {None}
    assert hit.keys() == miss.keys()
    for name, param in miss.items():
        assert hit[name].dtype == param.dtype and torch.equal(hit[name], param), name
    # The mapping is private: a parameter written leaves the entry as it was written.
    for param in hit.values():
        param.data.add_(1.0)
    assert entry.read_bytes() == written
    again = dict(loaded_model(gguf).named_parameters())
    for name, param in miss.items():
        assert torch.equal(again[name], param), name
    # Each parameter's mapping is its own: one let go (a dense weight freed once packed)
    # unmaps it, and the GGUF blocks, joined into fresh memory, leave none behind.
    del hit
    gc.collect()
    mapped = mappings_of(entry)
    assert mapped == len(again)
    again["model.layers.0.self_attn.qkv_proj.weight"].data = torch.empty(0)
    gc.collect()
    assert mappings_of(entry) == mapped - 1


def mappings_of(path: Path) -> int:
    """How many mappings of the file at `path` this process has."""
    with open("/proc/self/maps") as maps:
        return sum(line.rstrip().endswith(str(path)) for line in maps)
