"""The llama model's weight loading (model/llama.py): checkpoint names routed to the merged
layers' shards, tied embeddings, and clear errors for a checkpoint that does not fit."""

from __future__ import annotations

import pytest
import torch

from tokenserve.attention.selector import get_attention_backend
from tokenserve.config import KernelConfig
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.model.loader import iterate_weights
from tokenserve.model.registry import build_model

DENSE = KernelConfig(disable_onednn=True)  # the loaded weights stay as they are


def _model_and_weights(model_dir: str):
    model_config = EngineArgs(model=model_dir).create_engine_config().model_config
    backend = get_attention_backend(torch.device("cpu"), model_config.torch_dtype)
    model = build_model(model_config, backend, DENSE)
    return model, dict(iterate_weights(model_config.files))


def test_checkpoint_tensors_land_in_their_merged_shards(tiny_model_dirs):
    model, weights = _model_and_weights(tiny_model_dirs["qwen2"])
    model.load_weights(weights.items())
    layer, prefix = model.model.layers[1], "model.layers.1."
    qkv = [weights[f"{prefix}self_attn.{part}_proj.weight"] for part in "qkv"]
    qkv_bias = [weights[f"{prefix}self_attn.{part}_proj.bias"] for part in "qkv"]
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(qkv))
    assert torch.equal(layer.self_attn.qkv_proj.bias, torch.cat(qkv_bias))
    gate_up = [weights[f"{prefix}mlp.{part}_proj.weight"] for part in ("gate", "up")]
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat(gate_up))
    assert torch.equal(layer.mlp.down_proj.weight, weights[f"{prefix}mlp.down_proj.weight"])
    assert torch.equal(layer.input_layernorm.weight, weights[f"{prefix}input_layernorm.weight"])
    # Qwen2's tiny model ties its embeddings: one table, the LM head's weight too.
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"])


def test_a_tied_checkpoint_may_still_carry_the_head(tiny_model_dirs):
    model, weights = _model_and_weights(tiny_model_dirs["qwen2"])
    weights["lm_head.weight"] = torch.zeros_like(weights["model.embed_tokens.weight"])
    model.load_weights(weights.items())  # the copy is ignored
    assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"])


def test_a_checkpoint_that_does_not_fit_is_refused_by_name(tiny_model_dirs):
    model, weights = _model_and_weights(tiny_model_dirs["llama"])
    with pytest.raises(ValueError, match=r"missing 2 tensor\(s\): .*layers\.0\.self_attn\.k_proj"):
        model.load_weights((name, tensor) for name, tensor in weights.items()
                           if name not in ("model.layers.0.self_attn.k_proj.weight",
                                           "lm_head.weight"))
    with pytest.raises(ValueError, match="Unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        model.load_weights([*weights.items(), ("model.layers.0.mlp.extra.weight", torch.ones(1))])
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name] = weights[name][:, :10]
    with pytest.raises(ValueError, match=rf"Tensor '{name}': shape \(128, 10\) does not fit"):
        model.load_weights(weights.items())
