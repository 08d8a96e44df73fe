"""A worker: one device's share of the model, driven by the executor.

It owns its device and its ModelRunner; the executor reaches the runner only through the
worker's methods (`collective_rpc` calls them by name on every worker).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenserve.config import EngineConfig
from tokenserve.messages.model_runner_output import ModelRunnerOutput
from tokenserve.messages.scheduler_output import SchedulerOutput
from tokenserve.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from tokenserve.structured_output.manager import GrammarBitmask


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, device: torch.device | None = None):
        self.config = config
        self.rank = rank
        self.device = device or torch.device("cpu")
        self.model_runner = ModelRunner(config, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def initialize_kv_cache(self) -> None:
        self.model_runner.initialize_kv_cache()

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output, grammar_bitmask)

    def shutdown(self) -> None:
        self.model_runner.shutdown()
