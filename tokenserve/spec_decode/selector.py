"""`build_proposer`: the proposer `speculative_config` names, for the model runner (none
without speculation); the draft model's module is imported only when chosen."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenserve.config import EngineConfig
from tokenserve.spec_decode.proposer import NgramRunnerProposer, Proposer

if TYPE_CHECKING:
    from tokenserve.attention.backend import AttentionBackend


def build_proposer(
    config: EngineConfig, attention: AttentionBackend, device: torch.device
) -> Proposer | None:
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramRunnerProposer(config)
    from tokenserve.spec_decode.draft_model_proposer import DraftModelProposer

    return DraftModelProposer(config, attention, device)
