"""A worker: one device's share of the model, driven by the executor.

It owns its device, its place among the ranks (distributed/parallel_state.py: joined on
construction when there are several) and its ModelRunner; the executor reaches the runner
only through the worker's methods (`collective_rpc` calls them by name on every worker).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenserve.config import EngineConfig
from tokenserve.distributed.parallel_state import destroy_model_parallel, init_model_parallel
from tokenserve.messages.model_runner_output import ModelRunnerOutput
from tokenserve.messages.scheduler_output import SchedulerOutput
from tokenserve.worker.cpu_memory import keep_freed_memory
from tokenserve.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from tokenserve.structured_output.manager import GrammarBitmask


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        device: torch.device | None = None,
        distributed_init_method: str | None = None,
    ):
        self.config = config
        self.rank = rank
        self.device = device or torch.device("cpu")
        if self.device.type == "cpu":
            keep_freed_memory()  # activations reuse freed memory, not fresh pages
        self.parallel = init_model_parallel(
            config.parallel_config, rank, distributed_init_method, self.device
        )
        self.model_runner = ModelRunner(config, self.device, self.parallel)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def initialize_kv_cache(self) -> None:
        self.model_runner.initialize_kv_cache()

    def prefault_kv_cache(self, max_seconds: float) -> bool:
        return self.model_runner.prefault_kv_cache(max_seconds)

    def pack_weights(self) -> None:
        self.model_runner.pack_weights()

    def warm_up(self) -> bool:
        return self.model_runner.warm_up()

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output, grammar_bitmask)

    def shutdown(self) -> None:
        """Release what the runner holds (its KV connector), then leave the process group
        (the executor's workers, at the end)."""
        self.model_runner.shutdown()
        destroy_model_parallel()
