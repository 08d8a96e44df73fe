"""The weight cache's entries in the parameters' dtypes and its pruning
(model/weight_cache.py, model/weight_cache_pruning.py): a bf16 model's entry holds bf16
projections and loads the very model a fresh expansion loads; a damaged bf16 entry is
rebuilt; a model file's least recently used entries go when a new one is written."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest
import torch

from tests.model.test_weight_cache import (
    assert_identical,
    entries,
    forbid_expansion,
    fresh_expansion,
    write_quantized_gguf,
)
from tokenserve.attention.selector import get_attention_backend
from tokenserve.cache_dir import CACHE_DIR_ENV
from tokenserve.config import KernelConfig
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.model import gguf_loader, weight_cache, weight_cache_pruning
from tokenserve.model.loader import iterate_model_weights, resolve_model
from tokenserve.model.registry import build_model, get_model, process_weights_after_loading
from tokenserve.model.weight_cache import WeightDtypes

BF16_PROJECTIONS = WeightDtypes(
    {"model.layers.*.self_attn.qkv_proj.weight": torch.bfloat16,
     "model.layers.*.mlp.down_proj.weight": torch.bfloat16},
    {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"},
)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv(CACHE_DIR_ENV, str(directory))
    return directory


@pytest.fixture
def gguf_path(tmp_path: Path) -> str:
    return write_quantized_gguf(tmp_path / "tiny-q4_1.gguf")


def stored_dtypes(entry: Path) -> dict[str, str]:
    """Each dense weight's dtype as the entry's index records it."""
    data = entry.read_bytes()
    index_size, _ = struct.unpack_from("<Q8s", data, len(data) - 16)
    index = json.loads(data[len(data) - 16 - index_size : len(data) - 16])
    return {item["name"]: item["arrays"][0]["dtype"] for item in index["weights"]
            if item["form"] == "dense"}


def test_the_dtype_of_a_weight_is_its_parameters():
    assert BF16_PROJECTIONS.dtype_for("model.layers.7.self_attn.k_proj.weight") == torch.bfloat16
    assert BF16_PROJECTIONS.dtype_for("model.layers.0.mlp.down_proj.weight") == torch.bfloat16
    # float32 parameters, and any weight whose parameter is not known, stay float32
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.0.mlp.up_proj.weight",
                 "model.embed_tokens.weight", "something.else"):
        assert BF16_PROJECTIONS.dtype_for(name) == torch.float32
    assert WeightDtypes().key() == "" and BF16_PROJECTIONS.key() != ""


def test_a_bf16_entry_holds_bf16_weights_of_the_same_values(
    gguf_path: str, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    files = resolve_model(gguf_path)
    reference = [
        (name, weight.to(BF16_PROJECTIONS.dtype_for(name)) if isinstance(weight, torch.Tensor)
         else weight)
        for name, weight in fresh_expansion(files)
    ]
    assert_identical(list(iterate_model_weights(files, BF16_PROJECTIONS)), reference)  # miss
    [entry] = entries(cache_dir)
    dtypes = stored_dtypes(entry)
    assert dtypes["model.layers.1.self_attn.v_proj.weight"] == "bfloat16"
    assert dtypes["model.layers.1.mlp.gate_proj.weight"] == "float32"
    assert dtypes["model.embed_tokens.weight"] == "float32"
    forbid_expansion(monkeypatch)
    assert_identical(list(iterate_model_weights(files, BF16_PROJECTIONS)), reference)  # hit
    assert entries(cache_dir) == [entry]
    # Other dtypes, another entry: float32 from a float32 model's load.
    monkeypatch.undo()
    monkeypatch.setenv(CACHE_DIR_ENV, str(cache_dir))
    assert_identical(list(iterate_model_weights(files)), fresh_expansion(files))
    assert len(entries(cache_dir)) == 2


def model_state(gguf: str, cached: bool = True) -> dict[str, torch.Tensor]:
    """A bf16 model loaded by get_model (its weights as the cache gives them), or else from
    a fresh float32 expansion without the cache, prepacked: each parameter, oneDNN-packed
    weight and GGUF block array by name."""
    model_config = EngineArgs(model=gguf, dtype="bfloat16").create_engine_config().model_config
    backend = get_attention_backend(torch.device("cpu"), model_config.torch_dtype)
    if cached:
        model = get_model(model_config, backend, KernelConfig(), torch.device("cpu"))
    else:
        model = build_model(model_config, backend, KernelConfig())
        model.load_weights(fresh_expansion(model_config.files))
        process_weights_after_loading(model)
    state = {name: param.detach().clone() for name, param in model.named_parameters()}
    for name, module in model.named_modules():
        if getattr(module, "packed_weight", None) is not None:
            state[name + ".packed"] = module.packed_weight.to_dense()
        if getattr(module, "blocks", None) is not None:
            state[name + ".qs"], state[name + ".scales"] = module.blocks.qs, module.blocks.scales
    return state


def test_a_bf16_model_from_its_entry_is_the_model_a_fresh_expansion_loads(
    gguf_path: str, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    miss = model_state(gguf_path)
    [entry] = entries(cache_dir)
    assert "bfloat16" in stored_dtypes(entry).values()
    forbid_expansion(monkeypatch)
    hit = model_state(gguf_path)
    monkeypatch.undo()
    uncached = model_state(gguf_path, cached=False)  # float32, cast by the weight loaders
    assert any(t.dtype == torch.bfloat16 for t in uncached.values())
    for state in (miss, hit):
        assert state.keys() == uncached.keys()
        for name, tensor in uncached.items():
            assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name


def test_a_damaged_bf16_entry_is_rebuilt(gguf_path: str, cache_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch):
    files = resolve_model(gguf_path)
    reference = list(iterate_model_weights(files, BF16_PROJECTIONS))
    reference = [(name, w.clone() if isinstance(w, torch.Tensor) else w) for name, w in reference]
    [entry] = entries(cache_dir)
    data = bytearray(entry.read_bytes())
    data[100] ^= 0x01  # in the first arrays: only a checksum sees it
    entry.write_bytes(bytes(data))
    expansions = []
    expand = gguf_loader.iterate_gguf_weights
    monkeypatch.setattr(gguf_loader, "iterate_gguf_weights",
                        lambda *args: expansions.append(args) or expand(*args))
    assert_identical(list(iterate_model_weights(files, BF16_PROJECTIONS)), reference)
    assert len(expansions) == 1
    assert len(weight_cache.read_entry(str(entry))) == len(reference)


def age(path: Path, seconds: float) -> None:
    """Pretend `path` was last used `seconds` ago."""
    when = time.time() - seconds
    os.utime(path, (when, when))


def test_writing_an_entry_prunes_the_files_least_recently_used_ones(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    files = resolve_model(write_quantized_gguf(tmp_path / "tiny-q4_1.gguf"))
    other = resolve_model(write_quantized_gguf(tmp_path / "other" / "tiny-q4_1.gguf", seed=1))
    list(iterate_model_weights(other))  # another file of the same name: never pruned here
    [other_entry] = entries(cache_dir)
    weights_dir = cache_dir / "weights"
    dead = weights_dir / ".partial-dead"
    dead.write_bytes(b"a writer that died")
    alive = weights_dir / ".partial-alive"
    alive.write_bytes(b"a writer still writing")
    made = []
    for version in range(weight_cache_pruning.MAX_ENTRIES_PER_FILE + 1):
        monkeypatch.setattr(weight_cache, "code_version", lambda v=version: f"expansion {v}")
        list(iterate_model_weights(files))
        [new] = [p for p in entries(cache_dir) if p.name.startswith("tiny-q4_1-")
                 and p not in made and p != other_entry]
        made.append(new)
    # All within the last hour: kept (another install may be taking turns with this one).
    assert set(made) <= set(entries(cache_dir))
    for position, entry in enumerate(made):
        age(entry, 7200 - position)  # made[0] the least recently used
    age(other_entry, 7200)
    age(dead, 7200)
    # A hit on the oldest marks it used: it stays, the next oldest goes.
    monkeypatch.setattr(weight_cache, "code_version", lambda: "expansion 0")
    forbid_expansion(monkeypatch)
    list(iterate_model_weights(files))
    monkeypatch.undo()
    monkeypatch.setenv(CACHE_DIR_ENV, str(cache_dir))
    monkeypatch.setattr(weight_cache, "code_version", lambda: "expansion new")
    list(iterate_model_weights(files))  # a miss: written, then the file's others pruned
    left = set(entries(cache_dir))
    assert made[0] in left and made[1] not in left and made[2] not in left
    assert made[3] in left and other_entry in left and alive in left and dead not in left
    assert len([p for p in left if p.name.startswith("tiny-q4_1-") and p != other_entry]) == (
        weight_cache_pruning.MAX_ENTRIES_PER_FILE
    )


def test_marking_or_pruning_what_is_not_there_is_no_error():
    weight_cache_pruning.mark_used("/nonexistent/entry.bin")
    assert weight_cache_pruning.prune("/nonexistent/dir/x-y-z.bin") == []
