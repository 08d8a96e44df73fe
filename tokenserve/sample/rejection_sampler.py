"""Verifying draft tokens on the whole batch (speculative decoding), exactly.

A request with k drafts has k + 1 consecutive rows of logits: row j scores the token after
drafts[:j] (its sampling inputs saw those drafts as output, so penalties, bad words,
min_tokens and the grammar's mask apply per position). Every logits processor, then
temperature, min-p, top-k and top-p, give each row's target distribution p_j.

- Greedy rows accept drafts while they equal the argmax, then add the argmax of the first
  row that differs (or of the row after the last draft): the tokens one-at-a-time decoding
  gives.
- Random rows use standard speculative sampling: draft d_j (drawn from q_j) is accepted
  with probability min(1, p_j(d_j) / q_j(d_j)); the first rejected position draws from the
  normalized residual max(0, p_j - q_j) instead and ends the run; when all k are accepted,
  one more token is drawn from p_k. Each new token is then distributed as p. A proposal
  without probabilities (n-gram lookup, a greedy draft model) is a point mass: accepted
  with probability p_j(d_j), residual p_j without d_j.

A seeded request draws its uniforms from its own generator, in an order fixed by its own
drafts: its tokens depend on its seed, never on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenserve.sample.logits_processors import apply_logits_processors
from tokenserve.sample.logprobs import LogprobsTensors, compute_logprobs
from tokenserve.sample.sampler import Sampler, SamplingMetadata, greedy_tokens


@dataclass
class RejectionSamplerOutput:
    # Per request: its accepted drafts, then the token of the row after them.
    new_token_ids: list[list[int]]
    # Per row, when asked for: the logprobs of the token that row gave (rows past a
    # request's new tokens hold its argmax's, unused).
    logprobs: LogprobsTensors | None


class RejectionSampler:
    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        draft_token_ids: list[list[int]],
        draft_probs: list[torch.Tensor | None] | None = None,
    ) -> RejectionSamplerOutput:
        """`logits`: [sum(k_i + 1), vocab], request i's rows consecutive, in order;
        `draft_probs[i]`: [k_i, vocab], the distribution each draft was drawn from, or
        None for a point-mass proposal."""
        logits = logits.to(torch.float32, copy=True)
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)
        logits = apply_logits_processors(logits, metadata.processors)
        argmax = greedy_tokens(logits).tolist()
        probs = None if metadata.all_greedy else Sampler.probs(logits, metadata)
        greedy = metadata.greedy.tolist()
        row_tokens = list(argmax)
        new_token_ids = []
        row = 0
        for index, drafts in enumerate(draft_token_ids):
            rows = slice(row, row + len(drafts) + 1)
            if greedy[row]:
                tokens = accept_greedy(drafts, argmax[rows])
            else:
                assert probs is not None
                proposal = draft_probs[index] if draft_probs is not None else None
                tokens = accept_random(
                    drafts, probs[rows], proposal, metadata.generators.get(row)
                )
            row_tokens[row : row + len(tokens)] = tokens
            new_token_ids.append(tokens)
            row += len(drafts) + 1
        assert row == logits.shape[0], "one row per draft plus one per request"
        logprobs = None
        if raw_logprobs is not None:
            num_logprobs = min(metadata.max_num_logprobs or 0, logits.shape[-1])
            chosen = torch.tensor(row_tokens, device=logits.device)
            logprobs = compute_logprobs(raw_logprobs, chosen, num_logprobs)
        return RejectionSamplerOutput(new_token_ids, logprobs)


def accept_greedy(drafts: list[int], argmax: list[int]) -> list[int]:
    """Drafts while they equal the argmax of their row, then the first differing argmax
    (or the one after the last draft)."""
    tokens = []
    for draft, target in zip(drafts, argmax):
        tokens.append(target)
        if target != draft:
            return tokens
    tokens.append(argmax[len(drafts)])
    return tokens


def accept_random(
    drafts: list[int],
    probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """Speculative sampling for one request: `probs` [k + 1, vocab] are the target's
    distributions, `draft_probs` [k, vocab] the proposal's (None: point masses)."""
    # k uniforms drawn at once: a seeded request's sequence of draws depends only on its drafts.
    uniforms = torch.rand(len(drafts), generator=generator, device=probs.device).tolist()
    tokens = []
    for position, draft in enumerate(drafts):
        target = probs[position]
        proposed = 1.0 if draft_probs is None else float(draft_probs[position, draft])
        if uniforms[position] * proposed < float(target[draft]):
            tokens.append(draft)
            continue
        if draft_probs is None:
            residual = target.clone()
            residual[draft] = 0.0
        else:
            residual = (target - draft_probs[position]).clamp_min_(0.0)
        if not float(residual.sum()) > 0.0:
            residual = target  # p = q: a rejection has probability 0; keep the draw valid
        tokens.append(_draw(residual, generator))
        return tokens
    tokens.append(_draw(probs[len(drafts)], generator))
    return tokens


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn in proportion to `weights` (not necessarily normalized): the
    sampler's exponential race, argmax(w / E) with E ~ Exp(1)."""
    u = torch.empty_like(weights).uniform_(generator=generator)
    return int(weights.div(u.log_().neg_()).argmax())
