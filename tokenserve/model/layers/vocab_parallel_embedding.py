"""The token embedding and the LM head, their vocabulary rows split over the tensor-parallel
ranks.

A rank looks up only the ids in its share of the vocabulary (zeros for the rest, so the
ranks' results sum to the embedding) and computes the logits of its share (concatenated
over the ranks, they are all the logits). The sum and the concatenation run over the
tensor-parallel group (`tp_group`); without one the layers return their part
(`reduce_results=False`, `gather_output=False`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tokenserve.model.layers.linear import check_tp, divide, rank_slice
from tokenserve.model.layers.quantization.base import QuantizationMethod
from tokenserve.model.layers.weight_loading import Rows, copy_rows

if TYPE_CHECKING:
    from tokenserve.distributed.parallel_state import TensorParallelGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        params_dtype: torch.dtype = torch.float32,
        tp_size: int = 1,
        tp_rank: int = 0,
        reduce_results: bool = True,
        tp_group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        check_tp(tp_size, tp_rank)
        if tp_size > 1 and reduce_results and tp_group is None:
            raise ValueError(
                "summing the embedding over several ranks needs their group (tp_group); or "
                "pass reduce_results=False and sum the results."
            )
        self.tp_size, self.tp_rank, self.tp_group = tp_size, tp_rank, tp_group
        self.reduce_results = reduce_results and tp_size > 1
        self.num_embeddings_per_partition = divide(num_embeddings, tp_size)
        self.vocab_start = tp_rank * self.num_embeddings_per_partition
        self.vocab_end = self.vocab_start + self.num_embeddings_per_partition
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        self._load(param, rank_slice(loaded_weight, 0, self.tp_size, self.tp_rank))

    def _load(self, param: nn.Parameter, loaded_weight, rows: Rows = None) -> None:
        copy_rows(param, loaded_weight, rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        out = F.embedding((input_ids - self.vocab_start) * mine, self.weight)
        out = out * mine.unsqueeze(-1)
        return self.tp_group.all_reduce(out) if self.reduce_results else out


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden · Wᵀ for this rank's vocabulary rows: a linear layer whose weight
    lives in the form its quantization method keeps (the logits matrix of a GGUF model is
    read in its blocks by decode's few-row products)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        quant_method: QuantizationMethod,
        params_dtype: torch.dtype = torch.float32,
        tp_size: int = 1,
        tp_rank: int = 0,
        gather_output: bool = True,
        tp_group: TensorParallelGroup | None = None,
    ) -> None:
        if tp_size > 1 and gather_output and tp_group is None:
            raise ValueError(
                "gathering the logits of several ranks needs their group (tp_group); or pass "
                "gather_output=False and concatenate the results."
            )
        super().__init__(num_embeddings, embedding_dim, params_dtype=params_dtype,
                         tp_size=tp_size, tp_rank=tp_rank, reduce_results=False,
                         tp_group=tp_group)
        self.gather_output = gather_output and tp_size > 1
        self.quant_method = quant_method
        quant_method.create_weights(
            self, embedding_dim, [self.num_embeddings_per_partition], params_dtype
        )
        self.weight.weight_loader = self.weight_loader
        self.keep_dense_weight = False

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        """Use the embedding table as this head's weight (tie_word_embeddings): its one
        checkpoint tensor loads both, and the dense table stays for the lookup."""
        self.weight = embedding.weight
        self.keep_dense_weight = True
        embedding.weight.weight_loader = self.weight_loader

    def _load(self, param: nn.Parameter, loaded_weight, rows: Rows = None) -> None:
        self.quant_method.load_weight(self, loaded_weight, rows)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, hidden_states)
        return self.tp_group.all_gather(logits) if self.gather_output else logits
