"""The parallel linear layers (model/layers/linear.py): each weight loader puts its rank's
slice of a checkpoint tensor (of one part, for merged layers) in place, and a column-parallel
layer followed by a row-parallel one, run on every rank of a simulated tensor-parallel group
and summed, equals the unsharded pair."""

from __future__ import annotations

import pytest
import torch

from tokenserve.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from tokenserve.model.layers.quantization import UnquantizedLinearMethod

DENSE = UnquantizedLinearMethod(use_onednn=False)


def _random(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _load(layer, weight, bias=None, shard_id=None):
    layer.weight.weight_loader(layer.weight, weight, shard_id)
    if bias is not None:
        layer.bias.weight_loader(layer.bias, bias, shard_id)


def test_replicated_and_unsharded_layers_hold_the_whole_weight():
    weight, bias, x = _random(12, 8), _random(12, seed=1), _random(3, 8, seed=2)
    for layer in (ReplicatedLinear(8, 12, bias=True, quant_method=DENSE),
                  ColumnParallelLinear(8, 12, bias=True, quant_method=DENSE),
                  RowParallelLinear(8, 12, bias=True, quant_method=DENSE)):
        _load(layer, weight, bias)
        assert torch.equal(layer.weight, weight) and torch.equal(layer.bias, bias)
        torch.testing.assert_close(layer(x), x @ weight.T + bias)


def test_a_wrong_shape_is_refused():
    layer = ReplicatedLinear(8, 12, quant_method=DENSE)
    with pytest.raises(ValueError, match=r"shape \(12, 9\) does not fit"):
        _load(layer, _random(12, 9))
    qkv = QKVParallelLinear(8, 4, 2, 1, quant_method=DENSE)
    with pytest.raises(ValueError, match=r"shape \(8, 8\) does not fit .*\(4, 8\)"):
        _load(qkv, _random(8, 8), shard_id="k")  # k has one head of 4 rows
    with pytest.raises(ValueError, match="'q', 'k' or 'v'"):
        _load(qkv, _random(4, 8), shard_id=1)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_column_parallel_shards_take_their_rows(tp_rank):
    weight, bias = _random(12, 8), _random(12, seed=1)
    layer = ColumnParallelLinear(8, 12, bias=True, quant_method=DENSE, tp_size=2, tp_rank=tp_rank)
    _load(layer, weight, bias)
    rows = slice(6 * tp_rank, 6 * tp_rank + 6)
    assert torch.equal(layer.weight, weight[rows]) and torch.equal(layer.bias, bias[rows])


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_merged_gate_up_shards_take_their_rows_of_each_part(tp_rank):
    gate, up = _random(10, 8), _random(10, 8, seed=1)
    layer = MergedColumnParallelLinear(8, [10, 10], quant_method=DENSE, tp_size=2, tp_rank=tp_rank)
    _load(layer, up, shard_id=1)  # in any order
    _load(layer, gate, shard_id=0)
    rows = slice(5 * tp_rank, 5 * tp_rank + 5)
    assert torch.equal(layer.weight, torch.cat([gate[rows], up[rows]]))


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_qkv_shards_take_their_heads_of_each_part(tp_rank):
    head_size, heads, kv_heads, hidden = 4, 6, 2, 8
    q = _random(heads * head_size, hidden)
    k = _random(kv_heads * head_size, hidden, seed=1)
    v = _random(kv_heads * head_size, hidden, seed=2)
    q_bias, k_bias, v_bias = (_random(len(t), seed=3 + i) for i, t in enumerate((q, k, v)))
    layer = QKVParallelLinear(hidden, head_size, heads, kv_heads, bias=True, quant_method=DENSE,
                              tp_size=2, tp_rank=tp_rank)
    assert (layer.num_heads, layer.num_kv_heads) == (3, 1)
    for shard_id, weight, bias in (("q", q, q_bias), ("k", k, k_bias), ("v", v, v_bias)):
        _load(layer, weight, bias, shard_id)
    q_rows = slice(12 * tp_rank, 12 * tp_rank + 12)
    kv_rows = slice(4 * tp_rank, 4 * tp_rank + 4)
    assert torch.equal(layer.weight, torch.cat([q[q_rows], k[kv_rows], v[kv_rows]]))
    assert torch.equal(layer.bias, torch.cat([q_bias[q_rows], k_bias[kv_rows], v_bias[kv_rows]]))


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_row_parallel_shards_take_their_columns_and_rank_0_the_bias(tp_rank):
    weight, bias = _random(6, 16), _random(6, seed=1)
    layer = RowParallelLinear(16, 6, bias=True, quant_method=DENSE, tp_size=2, tp_rank=tp_rank,
                              reduce_results=False)
    _load(layer, weight, bias)
    assert torch.equal(layer.weight, weight[:, 8 * tp_rank : 8 * tp_rank + 8])
    assert torch.equal(layer.bias, bias)
    x = _random(3, 8, seed=2)
    expected = x @ weight[:, 8 * tp_rank : 8 * tp_rank + 8].T + (bias if tp_rank == 0 else 0)
    torch.testing.assert_close(layer(x), expected)


def test_column_then_row_parallel_summed_over_two_ranks_equals_the_whole_pair():
    hidden, intermediate = 16, 24
    gate, up = _random(intermediate, hidden), _random(intermediate, hidden, seed=1)
    down, down_bias = _random(hidden, intermediate, seed=2), _random(hidden, seed=3)
    x = _random(5, hidden, seed=4)

    def pair(tp_size: int, tp_rank: int) -> torch.Tensor:
        gate_up = MergedColumnParallelLinear(hidden, [intermediate] * 2, quant_method=DENSE,
                                             tp_size=tp_size, tp_rank=tp_rank)
        _load(gate_up, gate, shard_id=0)
        _load(gate_up, up, shard_id=1)
        down_proj = RowParallelLinear(intermediate, hidden, bias=True, quant_method=DENSE,
                                      tp_size=tp_size, tp_rank=tp_rank, reduce_results=False)
        _load(down_proj, down, down_bias)
        g, u = gate_up(x).chunk(2, dim=-1)
        return down_proj(torch.nn.functional.silu(g) * u)

    whole = pair(1, 0)
    g, u = x @ gate.T, x @ up.T
    torch.testing.assert_close(whole, (torch.nn.functional.silu(g) * u) @ down.T + down_bias)
    torch.testing.assert_close(pair(2, 0) + pair(2, 1), whole, rtol=1e-5, atol=1e-5)


def test_sharding_needs_even_splits_and_an_existing_rank():
    with pytest.raises(ValueError, match="does not split evenly over 2"):
        ColumnParallelLinear(8, 7, quant_method=DENSE, tp_size=2)
    with pytest.raises(ValueError, match="does not split evenly over 2"):
        QKVParallelLinear(8, 4, 9, 3, quant_method=DENSE, tp_size=2)
    with pytest.raises(ValueError, match="rank 2 of 2 does not exist"):
        ColumnParallelLinear(8, 8, quant_method=DENSE, tp_size=2, tp_rank=2)
    # A layer that would have to sum over ranks without their group says so.
    with pytest.raises(ValueError, match="needs their group"):
        RowParallelLinear(8, 8, quant_method=DENSE, tp_size=2)


def test_fewer_kv_heads_than_ranks_are_replicated():
    """4 query heads, 1 KV head, 2 ranks: each rank holds 2 query heads and the one KV head."""
    full = torch.randn(6 * 4, 8)
    parts = {"q": full[:16], "k": full[16:20], "v": full[20:]}
    for rank in range(2):
        layer = QKVParallelLinear(8, 4, 4, 1, quant_method=DENSE, tp_size=2, tp_rank=rank)
        assert (layer.num_heads, layer.num_kv_heads, layer.kv_head_replicas) == (2, 1, 2)
        for shard_id, weight in parts.items():
            layer.weight_loader(layer.weight, weight, shard_id)
        expected = torch.cat([parts["q"][rank * 8 : rank * 8 + 8], parts["k"], parts["v"]])
        assert torch.equal(layer.weight.data, expected)
