"""Draft-model proposals: a smaller model with the target's vocabulary proposes k tokens.

Its KV cache has the target's blocks (the same block ids, the same block tables, its own
tensors), so prefix-cache hits, preemption and freeing need nothing of their own: each
step, after the target, the draft computes the same tokens the target computed, then the
sampled requests' new tokens and k - 1 more positions of its own drafts. Those last
positions lie in KV slots the scheduler reserves past each request's tokens
(`num_lookahead_tokens`); the next step overwrites them with the accepted tokens.

Greedy requests get the draft's argmax (a point mass); random requests a draw from the
draft's distribution at their temperature, kept for the rejection sampler's p / q test.
A seeded request draws with a generator of its own, so its tokens stay reproducible.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenserve.attention.batch_layout import BatchLayout
from tokenserve.config import EngineConfig
from tokenserve.messages.scheduler_output import SchedulerOutput
from tokenserve.model.registry import get_model
from tokenserve.spec_decode.proposer import ProposerRequest, attention_rows, draft_room

if TYPE_CHECKING:
    from tokenserve.attention.backend import AttentionBackend

# Offsets a seeded request's draft generator from its own seed: independent draws.
DRAFT_SEED_OFFSET = 0x5EED


class DraftModelProposer:
    def __init__(
        self, config: EngineConfig, attention: AttentionBackend, device: torch.device
    ) -> None:
        assert config.speculative_config is not None
        self.config = config
        self.spec = config.speculative_config
        self.model_config = self.spec.draft_model_config
        self.attention = attention
        self.device = device
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.model_config.max_model_len
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        # Per request: how many of its positions hold the draft's K/V for its own tokens.
        self.num_computed: dict[str, int] = {}
        self.generators: dict[str, torch.Generator] = {}
        # Per random request: its latest drafts and the distributions they were drawn from.
        self.proposals: dict[str, tuple[list[int], torch.Tensor]] = {}

    def load_model(self) -> None:
        self.model = get_model(
            self.model_config, self.attention, self.config.kernel_config, self.device
        )

    def initialize_kv_cache(self) -> None:
        self.kv_caches = self.attention.allocate_kv_cache(
            num_layers=self.model_config.num_layers,
            num_blocks=self.config.cache_config.num_blocks,
            block_size=self.block_size,
            num_kv_heads=self.model_config.num_kv_heads,
            head_size=self.model_config.head_dim,
            dtype=self.config.cache_config.torch_dtype,
            device=self.device,
        )

    def draft_probs(self, request_id: str, drafts: list[int]) -> torch.Tensor | None:
        proposal = self.proposals.get(request_id)
        if proposal is None or proposal[0][: len(drafts)] != drafts:
            return None  # greedy drafts: point masses
        return proposal[1][: len(drafts)]

    @torch.inference_mode()
    def propose(
        self,
        scheduler_output: SchedulerOutput,
        requests: dict[str, ProposerRequest],
        sampled_ids: list[str],
    ) -> dict[str, list[int]]:
        assert self.model is not None, "load_model() must run before propose()"
        self._update(scheduler_output)
        sampled = set(sampled_ids)
        # Catch up: every token the target computed this step, and each sampled request's
        # new tokens (the last one's logits give its first draft).
        catch_up: list[tuple[ProposerRequest, int, int]] = []
        for request_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = requests[request_id]
            if request_id in sampled:
                end = state.num_tokens
            else:
                end = state.num_computed_tokens + num_scheduled
            start = self.num_computed.get(request_id, state.num_computed_tokens)
            if end > start:
                catch_up.append((state, start, end))
            self.num_computed[request_id] = max(start, end)
        if not catch_up:
            return {}
        speculate = self.spec.speculates(len(requests))
        rooms = {}
        for state, _, end in catch_up:
            if speculate and state.request_id in sampled:
                capacity = len(state.block_ids) * self.block_size
                room = min(
                    draft_room(state, self.spec.num_speculative_tokens, self.max_model_len),
                    capacity - end + 1,  # drafts 1..k-1 are written at end..end+k-2
                )
                if room > 0:
                    rooms[state.request_id] = room
        logits_rows = []
        proposing = []
        row = 0
        for state, start, end in catch_up:
            row += end - start
            if state.request_id in rooms:
                logits_rows.append(row - 1)
                proposing.append((state, end))
        hidden = self._forward(
            [(state, state.token_ids[start:end], start) for state, start, end in catch_up]
        )
        if not proposing:
            return {}
        drafts: dict[str, list[int]] = {state.request_id: [] for state, _ in proposing}
        probs: dict[str, list[torch.Tensor]] = {state.request_id: [] for state, _ in proposing}
        self._draw(proposing, self.model.compute_logits(hidden[logits_rows]), drafts, probs)
        for step in range(1, max(rooms.values())):
            active = [(s, end) for s, end in proposing if rooms[s.request_id] > step]
            if not active:
                break
            hidden = self._forward(
                [
                    (s, np.asarray(drafts[s.request_id][-1:], dtype=np.int64), end + step - 1)
                    for s, end in active
                ]
            )
            self._draw(active, self.model.compute_logits(hidden), drafts, probs)
        for request_id, rows in probs.items():
            if rows:
                self.proposals[request_id] = (drafts[request_id], torch.stack(rows))
            else:
                self.proposals.pop(request_id, None)
        return drafts

    def _update(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.num_computed.pop(request_id, None)
            self.proposals.pop(request_id, None)
            if request_id in scheduler_output.finished_req_ids:
                self.generators.pop(request_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            # Admitted (or resumed) after its prefix-cache hits: the draft's K/V of those
            # blocks was written by whichever request computed them first.
            self.num_computed[new.request_id] = new.num_computed_tokens
            params = new.sampling_params
            if params.seed is not None and new.request_id not in self.generators:
                self.generators[new.request_id] = torch.Generator(self.device).manual_seed(
                    params.seed + DRAFT_SEED_OFFSET
                )

    def _forward(self, rows: list[tuple[ProposerRequest, np.ndarray, int]]) -> torch.Tensor:
        """The draft model over (request, its tokens, their first position) rows."""
        assert self.model is not None
        token_ids = []
        layout = BatchLayout(self.block_size)
        for state, tokens, start in rows:
            end = start + len(tokens)
            token_ids.append(tokens)
            # A few tokens after a context (accepted drafts, the new token) as decode rows.
            split = start > 0 and len(tokens) <= self.spec.num_speculative_tokens + 1
            layout.add(start, end, state.block_ids, attention_rows(start, end, split))
        metadata = self.attention.build_metadata(layout.common_metadata(self.device))
        return self.model(
            torch.from_numpy(np.concatenate(token_ids)).to(self.device),
            layout.positions_tensor(self.device),
            self.kv_caches,
            metadata,
        )

    def _draw(
        self,
        rows: list[tuple[ProposerRequest, int]],
        logits: torch.Tensor,
        drafts: dict[str, list[int]],
        probs: dict[str, list[torch.Tensor]],
    ) -> None:
        """Each row's next draft: the argmax (greedy requests) or a draw at its temperature."""
        logits = logits.float()
        argmax = logits.argmax(dim=-1).tolist()
        for index, (state, _) in enumerate(rows):
            params = state.sampling_params
            if params.is_greedy:
                drafts[state.request_id].append(argmax[index])
                continue
            distribution = (logits[index] / params.temperature).softmax(dim=-1)
            generator = self.generators.get(state.request_id)
            token = int(torch.multinomial(distribution, 1, generator=generator))
            drafts[state.request_id].append(token)
            probs[state.request_id].append(distribution)
