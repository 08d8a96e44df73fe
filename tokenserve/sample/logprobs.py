"""Logprobs of chosen tokens and their top-k alternatives, for sampled and prompt positions.

They are the model's raw logprobs (log_softmax of the logits before temperature,
penalties or masks), as vLLM returns them by default. On the tensor side one
`LogprobsTensors` covers a whole step; `LogprobsLists` is the same data as plain lists,
cut per request, which is what crosses the engine-core boundary (messages/engine_core.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenserve.messages.engine_core import LogprobsLists


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor  # [num_positions, 1 + k] int64
    logprobs: torch.Tensor  # [num_positions, 1 + k] float32
    ranks: torch.Tensor  # [num_positions] int64

    def tolists(self, num_logprobs: list[int] | None = None) -> list[LogprobsLists]:
        """One single-position LogprobsLists per row, each cut to that row's own k."""
        token_ids, logprobs, ranks = (
            self.token_ids.tolist(),
            self.logprobs.tolist(),
            self.ranks.tolist(),
        )
        if num_logprobs is None:
            num_logprobs = [len(row) - 1 for row in token_ids]
        return [
            LogprobsLists([ids[: k + 1]], [lps[: k + 1]], [rank])
            for ids, lps, rank, k in zip(token_ids, logprobs, ranks, num_logprobs)
        ]

    def tolist(self) -> LogprobsLists:
        """All rows as one LogprobsLists (one request's positions)."""
        return LogprobsLists(self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist())


def compute_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """The chosen tokens' logprobs and ranks, and each row's `num_logprobs` most likely tokens.

    `logprobs` is [num_positions, vocab] (already log_softmax-ed), `token_ids` [num_positions].
    """
    token_ids = token_ids.long().unsqueeze(-1)
    chosen = logprobs.gather(-1, token_ids)
    ranks = (logprobs > chosen).sum(-1) + 1
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
        return LogprobsTensors(
            torch.cat([token_ids, top_ids], dim=-1),
            torch.cat([chosen, top_logprobs], dim=-1),
            ranks,
        )
    return LogprobsTensors(token_ids, chosen, ranks)
