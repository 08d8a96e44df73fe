"""The embedding and LM head split by vocabulary rows (model/layers/vocab_parallel_embedding.py):
each rank loads its rows; summed (embedding) or concatenated (logits) over a simulated
tensor-parallel group they equal the unsharded layer; a tied head shares the table."""

from __future__ import annotations

import pytest
import torch

from tokenserve.model.layers.quantization import UnquantizedLinearMethod
from tokenserve.model.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

VOCAB, HIDDEN = 12, 8


def _table() -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))


def test_embedding_shards_sum_to_the_whole_lookup():
    table, ids = _table(), torch.tensor([0, 5, 6, 11, 3])
    whole = VocabParallelEmbedding(VOCAB, HIDDEN)
    whole.weight.weight_loader(whole.weight, table)
    assert torch.equal(whole(ids), table[ids])
    parts = []
    for rank in (0, 1):
        shard = VocabParallelEmbedding(VOCAB, HIDDEN, tp_size=2, tp_rank=rank, reduce_results=False)
        shard.weight.weight_loader(shard.weight, table)
        assert torch.equal(shard.weight, table[6 * rank : 6 * rank + 6])
        parts.append(shard(ids))
    assert torch.equal(parts[0] + parts[1], table[ids])


@pytest.mark.parametrize("use_onednn", [False, True])
def test_lm_head_shards_concatenate_to_the_whole_logits(use_onednn):
    table, x = _table(), torch.randn(3, HIDDEN)
    method = UnquantizedLinearMethod(use_onednn=use_onednn)
    logits = []
    for rank in (0, 1):
        head = ParallelLMHead(VOCAB, HIDDEN, quant_method=method, tp_size=2, tp_rank=rank,
                              gather_output=False)
        head.weight.weight_loader(head.weight, table)
        method.process_weights_after_loading(head)
        logits.append(head(x))
    torch.testing.assert_close(torch.cat(logits, dim=-1), x @ table.T)


def test_a_tied_head_loads_through_the_embedding_and_keeps_the_table():
    table, x = _table(), torch.randn(3, HIDDEN)
    embedding = VocabParallelEmbedding(VOCAB, HIDDEN)
    method = UnquantizedLinearMethod(use_onednn=True)
    head = ParallelLMHead(VOCAB, HIDDEN, quant_method=method)
    head.tie_weights(embedding)
    embedding.weight.weight_loader(embedding.weight, table)  # the checkpoint's one tensor
    method.process_weights_after_loading(head)
    assert head.weight is embedding.weight and torch.equal(embedding.weight, table)
    torch.testing.assert_close(head(x), x @ table.T)
    assert torch.equal(embedding(torch.tensor([4])), table[[4]])  # the lookup still works
