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
        if scheduler_output.scheduled_spec_decode_tokens:
            self._check_drafts_supported(scheduler_output)
        return self.model_runner.execute_model(scheduler_output, grammar_bitmask)

    def _check_drafts_supported(self, scheduler_output: SchedulerOutput) -> None:
        """Refuse, before anything runs, draft tokens the runner cannot verify exactly.

        The runner samples every draft position with the request's own sampler, seeing the
        drafts before it as output (penalties, min_tokens and bad words included). Two
        kinds of per-request state it does not advance position by position: a seeded
        generator (a sampled row with `seed` draws one vector per step, and rejected
        positions would shift the sequence) and a structured-output grammar (its bitmask
        is for the first position only). A proposer must not propose drafts for those.
        """
        new_params = {
            new.request_id: new.sampling_params for new in scheduler_output.scheduled_new_reqs
        }
        for request_id in scheduler_output.scheduled_spec_decode_tokens:
            params = new_params.get(request_id)
            if params is None:
                params = self.model_runner.requests[request_id].sampling_params
            if params.structured_outputs is not None:
                raise NotImplementedError(
                    f"Request {request_id}: draft tokens are not verified for structured-output "
                    "requests (the grammar bitmask covers one position); do not propose for it."
                )
            if params.seed is not None and not params.is_greedy:
                raise NotImplementedError(
                    f"Request {request_id}: draft tokens are not verified for seeded random "
                    "sampling (its generator would not stay in step); do not propose for it."
                )
