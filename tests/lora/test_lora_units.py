"""LoRA's parts on their own: the batched shrink / expand equals each token's own adapter
applied alone, the block-hash key keeps adapters (and salts) apart, admission never
exceeds max_loras, and the settings and names are checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenserve.config import LoRAConfig
from tokenserve.core.block_hash import extend_block_hashes, get_hash_function
from tokenserve.core.lora_admission import admissible_by_adapter
from tokenserve.core.request import Request
from tokenserve.entrypoints.openai.serving_models import parse_lora_module
from tokenserve.lora.layers import LoRALinear
from tokenserve.lora.peft_loader import LoRAAdapter
from tokenserve.lora.punica import NO_LORA, LoRABatchMapping
from tokenserve.lora.request import LoRARequest
from tokenserve.model.layers.linear import QKVParallelLinear
from tokenserve.model.layers.quantization.unquantized import UnquantizedLinearMethod
from tokenserve.sampling_params import SamplingParams


def _adapter(lora_int_id: int, rank: int, scaling: float, generator) -> LoRAAdapter:
    sizes = {"q_proj": 32, "k_proj": 16, "v_proj": 16}
    weights = {
        (0, name): (torch.randn(rank, 24, generator=generator),
                    torch.randn(out, rank, generator=generator))
        for name, out in sizes.items() if not (lora_int_id == 2 and name == "k_proj")
    }
    return LoRAAdapter(LoRARequest(f"l{lora_int_id}", lora_int_id, "/x"), rank, scaling, weights)


def test_batched_products_equal_each_tokens_own_adapter():
    """A merged q/k/v layer with three slots: tokens of three adapters (one without k) and
    base tokens in one batch equal base + scaling · B · A · x per token, base tokens exactly."""
    generator = torch.Generator().manual_seed(0)
    base = QKVParallelLinear(24, 8, 4, 2, quant_method=UnquantizedLinearMethod(use_onednn=False))
    base.weight.data = torch.randn(64, 24, generator=generator)
    mapping = LoRABatchMapping(max_loras=3, max_rank=8, dtype=torch.float32,
                               device=torch.device("cpu"))
    layer = LoRALinear(base, ["q_proj", "k_proj", "v_proj"], mapping)
    adapters = [_adapter(1, 8, 2.0, generator), _adapter(2, 4, 0.5, generator),
                _adapter(3, 2, 1.5, generator)]
    for slot, adapter in enumerate(adapters):
        layer.set_slot(slot, adapter, 0)
        mapping.slot_scaling[slot] = adapter.scaling
    token_slots = np.array([NO_LORA, 0, 0, 1, NO_LORA, 2, 1, 2])
    x = torch.randn(len(token_slots), 24, generator=generator)
    mapping.update(token_slots)
    got = layer(x)
    base_out = base(x)
    for row, slot in enumerate(token_slots):
        expected = base_out[row].clone()
        if slot != NO_LORA:
            adapter = adapters[slot]
            first = 0
            for name, size in (("q_proj", 32), ("k_proj", 16), ("v_proj", 16)):
                if (0, name) in adapter.weights:
                    a, b = adapter.weights[(0, name)]
                    expected[first : first + size] += adapter.scaling * (b @ (a @ x[row]))
                first += size
            torch.testing.assert_close(got[row], expected, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got[row], expected)  # base tokens untouched
    # A step without adapters is the base layer itself.
    mapping.update(np.full(len(token_slots), NO_LORA))
    assert not mapping.has_adapters and torch.equal(layer(x), base_out)


def test_block_hash_keys_keep_adapters_and_salts_apart():
    hash_fn = get_hash_function("sha256")
    tokens = list(range(32))

    def hashes(salt, lora_key):
        out: list[bytes] = []
        extend_block_hashes(hash_fn, out, tokens, 16, salt, lora_key)
        return out

    a = LoRARequest("a", 1, "/a").block_hash_key
    b = LoRARequest("b", 2, "/b").block_hash_key
    variants = [hashes(None, None), hashes(None, a), hashes(None, b), hashes("s", a),
                hashes(a, None), hashes("s", None)]
    # Every block differs between any two variants (chained hashes: the first one suffices,
    # every block is checked), and a salt that spells an adapter's key is not that adapter.
    for i, first in enumerate(variants):
        for second in variants[i + 1 :]:
            assert all(x != y for x, y in zip(first, second))
    assert hashes(None, a) == hashes(None, a)


def _request(request_id: str, lora_int_id: int | None) -> Request:
    lora = LoRARequest(f"l{lora_int_id}", lora_int_id, "/x") if lora_int_id else None
    return Request(request_id, [1, 2], SamplingParams(), None, lora_request=lora)


def test_admission_never_exceeds_max_loras():
    running = [_request("r0", 1), _request("r1", None)]
    waiting = [_request("w0", 2), _request("w1", 3), _request("w2", None), _request("w3", 1),
               _request("w4", 2), _request("w5", 4)]
    admitted = list(admissible_by_adapter(waiting, running, max_loras=2))
    assert [r.request_id for r in admitted] == ["w0", "w2", "w3", "w4"]
    adapters = {r.lora_request.lora_int_id for r in running + admitted if r.lora_request}
    assert adapters == {1, 2}


def test_lora_settings_and_module_flags_are_checked():
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        LoRAConfig(max_lora_rank=0)
    assert parse_lora_module("sql=/ad/sql").path == "/ad/sql"
    module = parse_lora_module('{"name": "sql", "path": "/ad/sql", "base_model_name": "base"}')
    assert (module.name, module.path, module.base_model_name) == ("sql", "/ad/sql", "base")
    for bad in ("sql", "=/x", '{"name": "sql"}', '{"name": "a", "path": "/p", "x": 1}', "{bad"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)
