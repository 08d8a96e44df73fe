"""One rank's place among the ranks and the process groups it talks over.

Ranks are numbered pipeline stage first: rank = pp_rank * tp_size + tp_rank, so a stage's
tensor-parallel ranks are neighbours. `init_model_parallel` joins torch.distributed (gloo on
CPU, NCCL on CUDA) and builds one tensor-parallel group per stage; the result,
`ModelParallel`, is passed explicitly to the model and the runner (no module globals).
A single rank gets `ModelParallel()`, whose operations do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tokenserve.config import ParallelConfig, stage_layers


@dataclass
class TensorParallelGroup:
    """The ranks of one pipeline stage, each holding a slice of every layer."""

    size: int = 1
    rank: int = 0
    group: Any = None  # torch.distributed's ProcessGroup; None with one rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of x, in place (row-parallel layers, the embedding)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along dim in rank order (the LM head's logits)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


@dataclass
class PipelineStage:
    """This rank's stage: which layers it holds (`ParallelConfig.stage_layers`), and the peers
    it receives the residual stream from and sends it to (same tensor-parallel rank in the
    stage before and after)."""

    size: int = 1
    rank: int = 0
    # Global ranks of the peers; None at either end.
    prev_rank: int | None = None
    next_rank: int | None = None
    # The rank whose output is the step's (last stage, tensor-parallel rank 0).
    output_rank: int = 0

    def layers(self, num_layers: int) -> range:
        """The decoder layers this stage holds."""
        return stage_layers(num_layers, self.size, self.rank)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def send(self, tensors: list[torch.Tensor]) -> None:
        assert self.next_rank is not None, "the last stage sends nothing on"
        for tensor in tensors:
            dist.send(tensor.contiguous(), dst=self.next_rank)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, count: int) -> list[torch.Tensor]:
        assert self.prev_rank is not None, "the first stage receives token ids, not tensors"
        tensors = [torch.empty(shape, dtype=dtype) for _ in range(count)]
        for tensor in tensors:
            dist.recv(tensor, src=self.prev_rank)
        return tensors


@dataclass
class ModelParallel:
    """One rank's tensor-parallel group and pipeline stage."""

    tp: TensorParallelGroup = field(default_factory=TensorParallelGroup)
    pp: PipelineStage = field(default_factory=PipelineStage)
    rank: int = 0
    world_size: int = 1


def init_model_parallel(
    parallel_config: ParallelConfig, rank: int, init_method: str | None, device: torch.device
) -> ModelParallel:
    """Join the ranks (every rank calls this with the same `init_method`, e.g.
    tcp://host:port) and build the groups; one rank needs no process group."""
    world_size = parallel_config.world_size
    if world_size == 1:
        return ModelParallel()
    if init_method is None:
        raise ValueError("several ranks need a distributed init method (tcp://host:port).")
    tp_size, pp_size = parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank)
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = None
    if tp_size > 1 and pp_size > 1:
        # Every rank creates every group, in the same order (torch.distributed's rule).
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)]
        tp_group = groups[pp_rank]
    stage = PipelineStage(
        size=pp_size,
        rank=pp_rank,
        prev_rank=rank - tp_size if pp_rank > 0 else None,
        next_rank=rank + tp_size if pp_rank < pp_size - 1 else None,
        output_rank=(pp_size - 1) * tp_size,
    )
    return ModelParallel(TensorParallelGroup(tp_size, tp_rank, tp_group), stage, rank, world_size)


def destroy_model_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
