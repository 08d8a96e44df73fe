"""The model runner: turns a SchedulerOutput into one flat batch, runs the model, samples.

It keeps a CachedRequestState per running request, updated by the scheduler's diffs,
so that each step only the new tokens and new blocks cross over. Input preparation is
numpy over whole requests; the model sees [num_tokens] ids and positions, no padding.
Logits are computed for sampled rows and, for requests that asked for prompt logprobs,
for every prompt position of their chunk (only those rows).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenserve.attention.backend import AttentionMetadata, get_attention_backend
from tokenserve.config import EngineConfig
from tokenserve.core.scheduler_output import SchedulerOutput
from tokenserve.model import quantized
from tokenserve.model.loader import iterate_quantized_weights, iterate_weights
from tokenserve.model.registry import build_model
from tokenserve.sample.logits_processors import GrammarMask
from tokenserve.sample.logprobs import LogprobsLists, LogprobsTensors, compute_logprobs
from tokenserve.sample.sampler import Sampler
from tokenserve.worker.request_state import CachedRequestState
from tokenserve.worker.sampling_inputs import build_sampling_metadata

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from tokenserve.structured_output.manager import GrammarBitmask

# Prompt-logprob rows are turned into logits this many at a time, bounding the memory a
# long prompt needs ([rows, vocab] floats).
_PROMPT_LOGITS_CHUNK = 256


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]]
    # Only for requests that asked: the sampled token's logprobs, and (once, in the step
    # that samples the first token) the whole prompt's.
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device | None = None) -> None:
        self.config = config
        self.device = device or torch.device("cpu")
        self.block_size = config.cache_config.block_size
        model_config = config.model_config
        self.attention = get_attention_backend(
            self.device, model_config.dtype, cascade=not model_config.disable_cascade_attn
        )
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        # Per-request generators outlive preemption: a resumed request keeps drawing
        # from where it stopped.
        self.generators: dict[str, torch.Generator] = {}
        # Prompt logprobs gathered so far, across chunks (and preemptions); None once sent.
        self.prompt_logprobs: dict[str, LogprobsLists | None] = {}
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def load_model(self) -> None:
        model_config = self.config.model_config
        torch.manual_seed(model_config.seed)
        model = build_model(model_config, self.attention)
        model.load_weights(iterate_weights(model_config.files))
        self.model = model.to(self.device).eval()
        if self.device.type == "cpu":
            if model_config.dtype == torch.float32 and quantized.kernels_available():
                count = self.model.load_quantized_weights(
                    iterate_quantized_weights(model_config.files)
                )
                if count:
                    logger.info(
                        "%d weights also kept in their GGUF block form for products of up "
                        "to %d rows.", count, max(quantized.max_rows(), quantized.gemm_max_rows()),
                    )
            self.model.pack_weights()

    def initialize_kv_cache(self) -> None:
        model_config = self.config.model_config
        shape = (
            self.config.cache_config.num_blocks,
            model_config.num_kv_heads,
            self.block_size,
            model_config.head_dim,
        )
        # Zeroed, not empty: padded gathers read unused slots, which must hold finite values.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.config.cache_config.dtype, device=self.device),
                torch.zeros(shape, dtype=self.config.cache_config.dtype, device=self.device),
            )
            for _ in range(model_config.num_layers)
        ]

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        """Run one step. `grammar_bitmask` constrains the sampled rows of structured-output
        requests (the engine core's StructuredOutputManager fills it)."""
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput({})
        assert self.model is not None, "load_model() must run before execute_model()"

        request_ids = list(scheduler_output.num_scheduled_tokens)
        token_ids, positions, slots = [], [], []
        query_start_loc, seq_lens, block_tables = [0], [], []
        sampled_ids: list[str] = []
        logits_indices: list[int] = []
        # request id → (first prompt position of this chunk, flat index of it, count).
        prompt_rows: dict[str, tuple[int, int, int]] = {}
        for request_id in request_ids:
            state = self.requests[request_id]
            num_tokens = scheduler_output.num_scheduled_tokens[request_id]
            start = state.num_computed_tokens
            end = start + num_tokens
            token_ids.append(state.token_ids[start:end])
            request_positions = np.arange(start, end, dtype=np.int64)
            positions.append(request_positions)
            block_table = np.asarray(state.block_ids, dtype=np.int64)
            slots.append(
                block_table[request_positions // self.block_size] * self.block_size
                + request_positions % self.block_size
            )
            if request_id in self.prompt_logprobs:
                first, count = self._prompt_logprob_positions(state, start, end)
                if count > 0:
                    prompt_rows[request_id] = (first, query_start_loc[-1] + first - start, count)
            query_start_loc.append(query_start_loc[-1] + num_tokens)
            seq_lens.append(end)
            block_tables.append(state.block_ids)
            if end >= state.num_tokens:
                # The request's last known token is computed: its logits give the next one.
                sampled_ids.append(request_id)
                logits_indices.append(query_start_loc[-1] - 1)

        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(self.device),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            block_size=self.block_size,
        )
        self.attention.prepare(metadata, self.device)
        hidden_states = self.model(
            torch.from_numpy(np.concatenate(token_ids)).to(self.device),
            torch.from_numpy(np.concatenate(positions)).to(self.device),
            self.kv_caches,
            metadata,
        )
        for request_id, rows in prompt_rows.items():
            self._gather_prompt_logprobs(self.requests[request_id], hidden_states, *rows)
        if not sampled_ids:
            return ModelRunnerOutput({})
        return self._sample(sampled_ids, hidden_states[logits_indices], grammar_bitmask)

    def _sample(
        self,
        sampled_ids: list[str],
        hidden_states: torch.Tensor,
        grammar_bitmask: GrammarBitmask | None,
    ) -> ModelRunnerOutput:
        assert self.model is not None
        logits = self.model.compute_logits(hidden_states)
        states = [self.requests[request_id] for request_id in sampled_ids]
        metadata = build_sampling_metadata(
            states, self.generators, self.config.model_config.vocab_size, self.device
        )
        if grammar_bitmask is not None:
            row_of = {request_id: row for row, request_id in enumerate(sampled_ids)}
            metadata.processors.grammar = GrammarMask(
                [row_of[request_id] for request_id in grammar_bitmask.request_ids],
                grammar_bitmask.bitmask,
            )
        sampler_output = self.sampler(logits, metadata)
        new_tokens = sampler_output.token_ids.tolist()

        output = ModelRunnerOutput({})
        for state, token in zip(states, new_tokens):
            prompt_logprobs = self.prompt_logprobs.get(state.request_id)
            if prompt_logprobs is not None and state.num_output_tokens == 0:
                output.prompt_logprobs[state.request_id] = prompt_logprobs
                self.prompt_logprobs[state.request_id] = None
            state.append_token(token)
            output.sampled_token_ids[state.request_id] = [token]
        if sampler_output.logprobs is not None:
            rows = [row for row, s in enumerate(states) if s.sampling_params.logprobs is not None]
            wanted = sampler_output.logprobs
            if len(rows) < len(states):
                index = torch.tensor(rows, device=self.device)
                wanted = LogprobsTensors(
                    wanted.token_ids[index], wanted.logprobs[index], wanted.ranks[index]
                )
            num_logprobs = [states[row].sampling_params.logprobs or 0 for row in rows]
            for row, lists in zip(rows, wanted.tolists(num_logprobs)):
                output.logprobs[states[row].request_id] = lists
        return output

    def _prompt_logprob_positions(
        self, state: CachedRequestState, start: int, end: int
    ) -> tuple[int, int]:
        """Positions of this chunk whose logits score the next prompt token, not yet done.

        Position j's logits give the logprob of prompt token j + 1, for j < prompt length - 1.
        """
        done = self.prompt_logprobs[state.request_id]
        if done is None:
            return start, 0
        first = max(start, len(done))
        return first, max(0, min(end, state.num_prompt_tokens - 1) - first)

    def _gather_prompt_logprobs(
        self,
        state: CachedRequestState,
        hidden_states: torch.Tensor,
        first_position: int,
        first_index: int,
        count: int,
    ) -> None:
        assert self.model is not None
        num_logprobs = state.sampling_params.prompt_logprobs or 0
        num_logprobs = min(num_logprobs, self.config.model_config.vocab_size)
        done = self.prompt_logprobs[state.request_id]
        assert done is not None
        for offset in range(0, count, _PROMPT_LOGITS_CHUNK):
            rows = min(_PROMPT_LOGITS_CHUNK, count - offset)
            index = first_index + offset
            logits = self.model.compute_logits(hidden_states[index : index + rows]).float()
            position = first_position + offset
            targets = torch.from_numpy(state.token_ids[position + 1 : position + 1 + rows].copy())
            done.extend(
                compute_logprobs(
                    logits.log_softmax(dim=-1), targets.to(self.device), num_logprobs
                ).tolist()
            )

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_req_ids:
            self.requests.pop(request_id, None)
            self.generators.pop(request_id, None)
            self.prompt_logprobs.pop(request_id, None)
        for request_id in scheduler_output.preempted_req_ids:
            self.requests.pop(request_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            self.requests[new.request_id] = CachedRequestState.create(
                request_id=new.request_id,
                token_ids=new.token_ids,
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_id=new.eos_token_id,
            )
            if params.seed is not None and new.request_id not in self.generators:
                self.generators[new.request_id] = torch.Generator(self.device).manual_seed(
                    params.seed
                )
            if params.prompt_logprobs is not None and new.request_id not in self.prompt_logprobs:
                self.prompt_logprobs[new.request_id] = LogprobsLists([], [], [])
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
