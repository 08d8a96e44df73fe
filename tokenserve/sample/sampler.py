"""Turn one step's logits into tokens (and logprobs), for all sampled rows at once.

Order: raw logprobs (if any row wants them) → logits processors (allowed tokens, bans,
logit bias, penalties) → greedy rows take the argmax → random rows apply temperature,
min-p, top-k and top-p on the whole tensor, then draw with the exponential-race trick
(argmax of p / q with q ~ Exp(1)), which samples from p exactly. A seeded request draws
its q from its own generator, so its tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenserve.sample.logits_processors import LogitsProcessorInputs, apply_logits_processors
from tokenserve.sample.logprobs import LogprobsTensors, compute_logprobs


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [num_rows] float32; 1.0 on greedy rows
    greedy: torch.Tensor  # [num_rows] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [num_rows] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [num_rows] float32, 1.0 where disabled
    min_p: torch.Tensor | None = None  # [num_rows] float32, 0.0 where disabled
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    processors: LogitsProcessorInputs = field(default_factory=LogitsProcessorInputs)
    # The largest `logprobs` among the rows that asked for them; None when no row did.
    max_num_logprobs: int | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [num_rows] int64
    logprobs: LogprobsTensors | None  # [num_rows, 1 + max_num_logprobs] when asked for


class Sampler:
    def __init__(self, argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`argmax_rows`: a one-pass argmax of float32 or bfloat16 rows with
        `greedy_tokens`' answers (the C kernel of kernels/layer_ops.py, ~3x faster on [64,
        49152] float32 here), taken for such logits; `greedy_tokens` for the others, or when
        None."""
        self.argmax_rows = argmax_rows

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        if (
            self.argmax_rows is not None
            and logits.dtype in (torch.float32, torch.bfloat16)
            and logits.is_cpu
            and logits.is_contiguous()
            and logits.shape[-1] > 0
        ):
            return self.argmax_rows(logits)
        return greedy_tokens(logits)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """`logits` [rows, vocab] in float32, or in bfloat16 as a bf16 LM head writes them."""
        if metadata.all_greedy and metadata.max_num_logprobs is None and (
            not metadata.processors.any()
        ):
            # Nothing changes the logits: their argmax, in one pass (bf16 values as they
            # are; in float32 they would be the same numbers, so the same token).
            return SamplerOutput(self.greedy(logits), None)
        # A copy: the processors below work in place.
        logits = logits.to(torch.float32, copy=True)
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)
        logits = apply_logits_processors(logits, metadata.processors)
        token_ids = self._sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            num_logprobs = min(metadata.max_num_logprobs or 0, logits.shape[-1])
            logprobs = compute_logprobs(raw_logprobs, token_ids, num_logprobs)
        return SamplerOutput(token_ids, logprobs)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = self.greedy(logits)
        if metadata.all_greedy:
            return greedy
        random_tokens = exponential_race(self.probs(logits, metadata), metadata.generators)
        return torch.where(metadata.greedy, greedy, random_tokens)

    @staticmethod
    def probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution a random row draws from: processed `logits` under temperature,
        min-p, top-k and top-p (meaningless on greedy rows)."""
        logits = logits / metadata.temperature.unsqueeze(1)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        return logits.softmax(dim=-1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima, NaN above all, as `argmax`): `max`'s
    indices, which PyTorch's CPU kernels find a few times faster than `argmax` does."""
    return logits.max(dim=-1).indices


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask every token whose probability is below min_p × the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) every logit outside each row's top-k and top-p nucleus.

    Only the largest top-k of the batch is ranked (`torch.topk`), not the whole
    vocabulary: a full sort happens only when some row uses top-p without top-k.
    """
    if top_k is None and top_p is None:
        return logits
    num_candidates = logits.shape[-1] if top_k is None else int(top_k.max())
    if num_candidates == logits.shape[-1]:
        sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
    else:
        sorted_logits, sorted_index = logits.topk(num_candidates, dim=-1)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        ranks = torch.arange(num_candidates, device=logits.device)
        remove |= ranks.unsqueeze(0) >= top_k.unsqueeze(1)
    if top_p is not None:
        # Tokens past the candidates are outside top-k: the softmax over the kept
        # candidates is the distribution top-k leaves.
        sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # Mass strictly before each token; a token is kept while that mass is below p,
        # so the most likely token always survives.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        remove |= mass_before >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, sorted_index, sorted_logits)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(p / q), q ~ Exp(1): a draw from p. q = -log(u), u ~ U[0, 1), which is
    several times faster than `exponential_` on CPU; u = 0 gives q = inf, a token that
    simply does not win."""
    u = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        u.uniform_()
    for row, generator in generators.items():
        u[row].uniform_(generator=generator)
    return greedy_tokens(probs.div(u.log_().neg_()))
