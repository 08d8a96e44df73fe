"""Linear layers that tensor parallelism shards, in vLLM's shapes.

Column-parallel layers split the output rows over the `tp_size` ranks (merged gate/up and
q/k/v split each part), row-parallel layers split the input columns, so that a column-
parallel layer followed by a row-parallel one needs a single sum over the ranks at the end.
Each parameter's `weight_loader(param, loaded_weight, shard_id)` takes the full checkpoint
tensor (of one part, for merged layers) and puts this rank's slice of it in place; the
weight itself lives in the form its quantization method keeps, which also does the
multiplication. A row-parallel layer sums its result over its tensor-parallel group
(`tp_group`, distributed/parallel_state.py); without one (`reduce_results=False`) it returns
its partial sum and the all-reduce is the caller's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenserve.model.layers.quantization.base import QuantizationMethod
from tokenserve.model.layers.weight_loading import Rows, copy_rows

if TYPE_CHECKING:
    from tokenserve.distributed.parallel_state import TensorParallelGroup


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{numerator} does not split evenly over {denominator} tensor-parallel ranks."
        )
    return numerator // denominator


def check_tp(tp_size: int, tp_rank: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} of {tp_size} does not exist.")


def rank_slice(loaded_weight, dim: int, tp_size: int, tp_rank: int):
    """This rank's equal share of a checkpoint tensor (or GGUF blocks) along dim."""
    if tp_size == 1:
        return loaded_weight
    size = divide(loaded_weight.shape[dim], tp_size)
    return loaded_weight.narrow(dim, tp_rank * size, size)


class LinearBase(nn.Module):
    """y = x · Wᵀ (+ b) for this rank's part of W; the quantization method keeps W and
    multiplies by it."""

    def __init__(
        self,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        bias: bool,
        quant_method: QuantizationMethod,
        params_dtype: torch.dtype,
        tp_size: int,
        tp_rank: int,
    ) -> None:
        super().__init__()
        check_tp(tp_size, tp_rank)
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = output_partition_sizes
        self.output_size_per_partition = sum(output_partition_sizes)
        self.quant_method = quant_method
        quant_method.create_weights(
            self, input_size_per_partition, output_partition_sizes, params_dtype
        )
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.output_size_per_partition, dtype=params_dtype),
                requires_grad=False,
            )
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def input_dtype(self, rows: int) -> torch.dtype | None:
        """What a product of `rows` rows reads where it is not the activations' dtype (bf16
        products: the operator before may hand its result in it); None otherwise."""
        return self.quant_method.input_dtype(self, rows)

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        raise NotImplementedError

    def _load(self, param: nn.Parameter, loaded_weight, rows: Rows = None) -> None:
        """The weight goes through the quantization method (which may keep another form of
        it), the bias straight in."""
        if param is self.weight:
            self.quant_method.load_weight(self, loaded_weight, rows)
        else:
            copy_rows(param, loaded_weight, rows)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        quant_method: QuantizationMethod,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(input_size, [output_size], bias, quant_method, params_dtype, 1, 0)

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        self._load(param, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """The output rows split over the ranks: rank r computes rows r * n / tp_size onward."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        quant_method: QuantizationMethod,
        params_dtype: torch.dtype = torch.float32,
        tp_size: int = 1,
        tp_rank: int = 0,
        output_sizes: list[int] | None = None,
    ) -> None:
        # Merged layers split each of their parts (output_sizes) over the ranks.
        parts = output_sizes or [output_size]
        super().__init__(
            input_size, [divide(size, tp_size) for size in parts], bias, quant_method,
            params_dtype, tp_size, tp_rank,
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        self._load(param, rank_slice(loaded_weight, 0, self.tp_size, self.tp_rank))

    def _load_part(self, param: nn.Parameter, loaded_weight, index: int) -> None:
        """Part `index` of a merged layer: this rank's slice of it, at its rows."""
        self._load_rows(param, rank_slice(loaded_weight, 0, self.tp_size, self.tp_rank), index)

    def _load_rows(self, param: nn.Parameter, rank_part, index: int) -> None:
        """This rank's rows of part `index`, at their place in the merged weight."""
        first = sum(self.output_partition_sizes[:index])
        self._load(param, rank_part, (first, self.output_partition_sizes[index]))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers of one input in one weight (gate and up): shard_id is
    the part's index."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool = False,
        quant_method: QuantizationMethod,
        params_dtype: torch.dtype = torch.float32,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        super().__init__(
            input_size, sum(output_sizes), bias=bias, quant_method=quant_method,
            params_dtype=params_dtype, tp_size=tp_size, tp_rank=tp_rank, output_sizes=output_sizes,
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_partition_sizes):
            raise ValueError(f"shard_id must be a part's index, got {shard_id!r}.")
        self._load_part(param, loaded_weight, shard_id)


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections in one weight, each split by heads over the
    ranks: shard_id is "q", "k" or "v". With fewer KV heads than ranks, each rank holds one
    KV head, shared by tp_size / num_kv_heads neighbouring ranks (replicated)."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        *,
        bias: bool = False,
        quant_method: QuantizationMethod,
        params_dtype: torch.dtype = torch.float32,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp_size)
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads, self.kv_head_replicas = divide(total_num_kv_heads, tp_size), 1
        else:
            self.num_kv_heads, self.kv_head_replicas = 1, divide(tp_size, total_num_kv_heads)
        # The K and V parts as if every rank had its own heads (the replicas counted apart).
        q_size, kv_size = total_num_heads * head_size, self.num_kv_heads * tp_size * head_size
        super().__init__(
            hidden_size, q_size + 2 * kv_size, bias=bias, quant_method=quant_method,
            params_dtype=params_dtype, tp_size=tp_size, tp_rank=tp_rank,
            output_sizes=[q_size, kv_size, kv_size],
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}.")
        index = "qkv".index(shard_id)
        if index == 0 or self.kv_head_replicas == 1:
            self._load_part(param, loaded_weight, index)
            return
        # A replicated KV head: the one this rank's query heads attend with.
        size = self.num_kv_heads * self.head_size
        first = self.tp_rank // self.kv_head_replicas * size
        self._load_rows(param, loaded_weight.narrow(0, first, size), index)


class RowParallelLinear(LinearBase):
    """The input columns split over the ranks: each rank multiplies its slice of x (the
    output of a column-parallel layer) and the ranks' results sum to x · Wᵀ, over `tp_group`
    unless `reduce_results` is False. The bias is added once, by rank 0."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        quant_method: QuantizationMethod,
        params_dtype: torch.dtype = torch.float32,
        tp_size: int = 1,
        tp_rank: int = 0,
        reduce_results: bool = True,
        tp_group: TensorParallelGroup | None = None,
    ) -> None:
        if tp_size > 1 and reduce_results and tp_group is None:
            raise ValueError(
                "summing a row-parallel layer over several ranks needs their group (tp_group); "
                "or pass reduce_results=False and sum the results."
            )
        self.reduce_results = reduce_results and tp_size > 1
        super().__init__(
            divide(input_size, tp_size), [output_size], bias, quant_method, params_dtype,
            tp_size, tp_rank,
        )
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.reduce_results:
            if out.dtype != torch.float32 and out.dtype == self.input_dtype(x.shape[0]):
                out = out.float()  # a bf16 product's partial sums add up in float32
            out = self.tp_group.all_reduce(out)
        return out

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        if param is self.weight:
            loaded_weight = rank_slice(loaded_weight, 1, self.tp_size, self.tp_rank)
        self._load(param, loaded_weight)
