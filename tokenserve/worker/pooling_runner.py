"""The pooling side of the model runner (`--runner pooling`): a step's forward, each prompt's
hidden states pooled (last token, mean, or the first token), the model's head, and each
request's task head. A request whose prompt this step completes gets its result in
`ModelRunnerOutput.pooler_output`; nothing is sampled.

Decoder prompts may be split across steps (chunked prefill): the last token needs only the
final chunk (so the prefix cache can serve the rest), the mean is summed chunk by chunk and
the first token kept from the first chunk (the processor keeps those two off the prefix
cache). Encoders (BERT) get whole prompts and their token types, and keep no KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenserve.config import EngineConfig
from tokenserve.messages.model_runner_output import ModelRunnerOutput
from tokenserve.messages.scheduler_output import SchedulerOutput
from tokenserve.model.pooler import apply_task_head
from tokenserve.pooling_params import PoolingParams
from tokenserve.worker.request_state import CachedRequestState


@dataclass
class PoolingState:
    """What one request's pooling keeps between its prompt's chunks."""

    params: PoolingParams
    task: str
    # MEAN: the sum of the hidden states computed so far; CLS: the first position's.
    partial: torch.Tensor | None = None


class PoolingRunner:
    def __init__(self, config: EngineConfig) -> None:
        model_config = config.model_config
        assert model_config.pooler_config is not None, "the pooling runner needs a pooler config"
        self.pooling_type = model_config.pooler_config.pooling_type
        self.normalize = model_config.pooler_config.normalize
        self.default_task = model_config.pooling_tasks[0]
        self.is_encoder_only = model_config.is_encoder_only
        self.states: dict[str, PoolingState] = {}

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Forget finished requests; start afresh for admitted ones (a preempted request is
        computed again from its first token)."""
        for request_id in (*scheduler_output.finished_req_ids, *scheduler_output.preempted_req_ids):
            self.states.pop(request_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.pooling_params
            if params is None:
                raise ValueError(f"Request {new.request_id!r} has no pooling params: this "
                                 "engine runs the pooling runner, which samples nothing.")
            self.states[new.request_id] = PoolingState(params, params.task or self.default_task)

    def execute(
        self,
        model: torch.nn.Module,
        request_ids: list[str],
        requests: dict[str, CachedRequestState],
        query_start_loc: list[int],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata,
    ) -> ModelRunnerOutput:
        """The step's forward, then the results of the requests whose prompt it completes."""
        if self.is_encoder_only:
            hidden_states = model(
                input_ids, positions, kv_caches, metadata,
                token_type_ids=self._token_type_ids(request_ids, query_start_loc, positions),
                query_start_loc=query_start_loc,
            )
        else:
            hidden_states = model(input_ids, positions, kv_caches, metadata)
        finished: list[str] = []
        pooled: list[torch.Tensor] = []
        for index, request_id in enumerate(request_ids):
            request = requests[request_id]
            rows = hidden_states[query_start_loc[index] : query_start_loc[index + 1]]
            start = request.num_computed_tokens
            vector = self._pool(self.states[request_id], rows, start, request.num_prompt_tokens)
            if vector is not None:
                finished.append(request_id)
                pooled.append(vector)
        output = ModelRunnerOutput()
        if not finished:
            return output
        head_outputs = model.pooler_head(torch.stack(pooled))
        for request_id, head_output in zip(finished, head_outputs):
            state = self.states[request_id]
            result = apply_task_head(head_output, state.params, state.task, self.normalize)
            output.pooler_output[request_id] = result.tolist()
        return output

    def _pool(
        self, state: PoolingState, rows: torch.Tensor, start: int, num_prompt_tokens: int
    ) -> torch.Tensor | None:
        """Fold this chunk (prompt positions start..start + len(rows)) in; the pooled vector
        once the prompt is complete, else None."""
        end = start + rows.shape[0]
        if self.pooling_type == "MEAN":
            chunk_sum = rows.float().sum(dim=0)
            state.partial = chunk_sum if state.partial is None else state.partial + chunk_sum
        elif self.pooling_type == "CLS" and start == 0:
            state.partial = rows[0]
        if end < num_prompt_tokens:
            return None
        if self.pooling_type == "LAST":
            return rows[-1]
        assert state.partial is not None, "MEAN / CLS pooling computes the prompt from its start"
        if self.pooling_type == "MEAN":
            return (state.partial / num_prompt_tokens).to(rows.dtype)
        return state.partial

    def _token_type_ids(
        self, request_ids: list[str], query_start_loc: list[int], positions: torch.Tensor
    ) -> torch.Tensor:
        """0 for the first text of each prompt, 1 from the second text of a pair on."""
        token_types = torch.zeros_like(positions)
        for index, request_id in enumerate(request_ids):
            boundary = self.states[request_id].params.token_type_start
            if boundary is not None:
                span = slice(query_start_loc[index], query_start_loc[index + 1])
                token_types[span] = (positions[span] >= boundary).to(positions.dtype)
        return token_types
