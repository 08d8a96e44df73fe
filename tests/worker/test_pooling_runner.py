"""The pooling runner folds a prompt's chunks into its pooled vector: the last token once
the prompt is complete, the mean over every chunk, the first token kept from the first
chunk; a preempted request starts over, so its result does not depend on the preemption."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenserve.config import PoolerConfig
from tokenserve.messages.scheduler_output import NewRequestData, SchedulerOutput
from tokenserve.pooling_params import PoolingParams
from tokenserve.sampling_params import SamplingParams
from tokenserve.worker.pooling_runner import PoolingRunner

HIDDEN = 4


class PositionModel(torch.nn.Module):
    """Hidden state of a token: a vector from its id and position (no attention needed)."""

    def forward(self, input_ids, positions, kv_caches, metadata):
        base = (input_ids * 10 + positions).float().unsqueeze(-1)
        return base * torch.arange(1, HIDDEN + 1, dtype=torch.float32)

    def pooler_head(self, pooled):
        return pooled


def _runner(pooling_type: str) -> PoolingRunner:
    model_config = SimpleNamespace(
        pooler_config=PoolerConfig(pooling_type=pooling_type, normalize=False),
        pooling_tasks=("embed",),
        is_encoder_only=False,
    )
    return PoolingRunner(SimpleNamespace(model_config=model_config))


def _admit(runner: PoolingRunner, request_id: str, num_prompt_tokens: int) -> None:
    new = NewRequestData(
        request_id, list(range(num_prompt_tokens)), num_prompt_tokens, SamplingParams(), [], 0,
        pooling_params=PoolingParams(),
    )
    runner.update_states(SchedulerOutput(scheduled_new_reqs=[new]))


def _step(runner, token_ids, start, num_prompt_tokens):
    """One chunk of one request, token_ids[start:start + len]; its result, if complete."""
    request = SimpleNamespace(num_computed_tokens=start, num_prompt_tokens=num_prompt_tokens)
    ids = torch.tensor(token_ids)
    positions = torch.arange(start, start + len(token_ids))
    output = runner.execute(
        PositionModel(), ["r"], {"r": request}, [0, len(token_ids)], ids, positions, [], None
    )
    return output.pooler_output.get("r")


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_chunks_and_preemption_give_the_whole_prompt_result(pooling_type):
    prompt = [5, 3, 8, 1, 9, 2, 7]
    whole = PositionModel()(torch.tensor(prompt), torch.arange(len(prompt)), [], None)
    expected = {"LAST": whole[-1], "MEAN": whole.mean(dim=0), "CLS": whole[0]}[pooling_type]

    runner = _runner(pooling_type)
    _admit(runner, "r", len(prompt))
    assert _step(runner, prompt[:3], 0, len(prompt)) is None
    # Preempted after its first chunk: re-admitted, it is computed from its first token.
    runner.update_states(SchedulerOutput(preempted_req_ids={"r"}))
    _admit(runner, "r", len(prompt))
    assert _step(runner, prompt[:4], 0, len(prompt)) is None
    result = _step(runner, prompt[4:], 4, len(prompt))
    assert result == pytest.approx(expected.tolist())
