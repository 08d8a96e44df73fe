"""The configuration's dtypes are names (config.py, model/dtype_names.py): what `--dtype`
and `--kv-cache-dtype` resolve to, and the torch dtypes the engine side reads from them."""

from __future__ import annotations

import pickle

import pytest
import torch

from tokenserve.config import DTYPE_SIZES, torch_dtype
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.model import dtype_names
from tokenserve.model.precision import activation_dtype, resolve_dtype


@pytest.mark.parametrize(
    ("given", "name"),
    [("float32", "float32"), ("fp32", "float32"), ("float", "float32"), ("bf16", "bfloat16"),
     ("bfloat16", "bfloat16"), ("half", "float16"), ("fp16", "float16"),
     (torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (torch.float32, "float32")],
)
def test_a_dtype_resolves_to_its_name_and_back(given, name):
    assert dtype_names.resolve_dtype_name(given) == name
    assert resolve_dtype(given) == torch_dtype(name) == getattr(torch, name)
    assert torch.empty((), dtype=torch_dtype(name)).element_size() == DTYPE_SIZES[name]


@pytest.mark.parametrize("given", ["float64", torch.float64, torch.int8, None, 3])
def test_a_dtype_without_a_name_is_refused(given):
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        dtype_names.resolve_dtype_name(given)


@pytest.mark.auto_dtype  # the CPU's own "auto", not the tests' float32 (tests/conftest.py)
def test_auto_is_the_cpus_native_dtype(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(dtype_names.cpu_isa, "native_bf16", lambda isa=None: True)
    assert dtype_names.resolve_dtype_name("auto") == "bfloat16"
    monkeypatch.setattr(dtype_names.cpu_isa, "native_bf16", lambda isa=None: False)
    assert dtype_names.resolve_dtype_name("auto") == "float32"


def test_the_configuration_holds_names_the_engine_reads_as_torch_dtypes(tiny_model_dirs):
    config = EngineArgs(
        model=tiny_model_dirs["llama"], dtype=torch.bfloat16, kv_cache_memory="1MiB"
    ).create_engine_config()
    model_config, cache_config = config.model_config, config.cache_config
    assert (model_config.dtype, cache_config.dtype) == ("bfloat16", "bfloat16")
    assert model_config.torch_dtype is torch.bfloat16 and cache_config.torch_dtype is torch.bfloat16
    assert activation_dtype(model_config.dtype) is torch.float32  # bf16 products, f32 the rest
    # 2 layers x (K + V) x 2 kv heads x 16 head dim, in 2 or 4 bytes.
    assert model_config.kv_bytes_per_token() == 256
    assert model_config.kv_bytes_per_token("float32") == 512
    # What crosses to the engine process (and back, in the ready handshake) holds no torch.
    assert b"torch" not in pickle.dumps(cache_config)
    assert pickle.loads(pickle.dumps(cache_config)) == cache_config
