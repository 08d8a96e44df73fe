"""Per-request changes to the logits, applied to a whole step's rows at once.

Each processor takes only the rows that need it (`rows` index the step's logits), so a
batch mixing requests with and without a feature pays for the feature on its own rows.
Order: the structured-output grammar's mask, the allowed-token mask, banned tokens (bad
words, stop tokens held back by min_tokens), logit bias, then the penalties.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GrammarMask:
    """Rows constrained by a grammar: packed bitmasks, bit t % 32 of word t // 32 set
    where token t may be sampled."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32


@dataclass
class AllowedTokens:
    rows: torch.Tensor  # [m] int64
    mask: torch.Tensor  # [m, vocab] bool, True where the token may be sampled


@dataclass
class BannedTokens:
    """(row, token) pairs that may not be sampled this step."""

    rows: torch.Tensor  # [num_pairs] int64
    token_ids: torch.Tensor  # [num_pairs] int64


@dataclass
class LogitBias:
    rows: torch.Tensor  # [num_pairs] int64
    token_ids: torch.Tensor  # [num_pairs] int64
    values: torch.Tensor  # [num_pairs] float32


@dataclass
class Penalties:
    rows: torch.Tensor  # [m] int64
    # Each row's output token ids so far, padded with vocab_size (dropped when counting).
    output_token_ids: torch.Tensor  # [m, max_output_len] int64
    prompt_mask: torch.Tensor  # [m, vocab] bool: the token occurs in the prompt
    presence: torch.Tensor  # [m] float32
    frequency: torch.Tensor  # [m] float32
    repetition: torch.Tensor  # [m] float32


@dataclass
class LogitsProcessorInputs:
    grammar: GrammarMask | None = None
    allowed: AllowedTokens | None = None
    banned: BannedTokens | None = None
    logit_bias: LogitBias | None = None
    penalties: Penalties | None = None

    def any(self) -> bool:
        """Whether some processor changes the logits this step."""
        return any(
            inputs is not None
            for inputs in (self.grammar, self.allowed, self.banned, self.logit_bias,
                           self.penalties)
        )


def apply_logits_processors(logits: torch.Tensor, inputs: LogitsProcessorInputs) -> torch.Tensor:
    """Apply every processor in `inputs` to `logits` ([num_rows, vocab] float32, in place)."""
    if inputs.grammar is not None:
        apply_grammar_mask(logits, inputs.grammar)
    if inputs.allowed is not None:
        rows = inputs.allowed.rows
        logits[rows] = logits[rows].masked_fill(~inputs.allowed.mask, float("-inf"))
    if inputs.banned is not None:
        logits[inputs.banned.rows, inputs.banned.token_ids] = float("-inf")
    if inputs.logit_bias is not None:
        bias = inputs.logit_bias
        logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
    if inputs.penalties is not None:
        p = inputs.penalties
        logits[p.rows] = apply_penalties(
            logits[p.rows], p.prompt_mask, p.output_token_ids, p.presence, p.frequency, p.repetition
        )
    return logits


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """-inf where the grammar forbids a token, on the mask's rows only (xgrammar's kernel)."""
    from tokenserve.structured_output.grammar import apply_token_bitmask

    # The kernel indexes the logits and the bitmask with the same row numbers.
    bitmask = torch.full((logits.shape[0], mask.bitmask.shape[1]), -1, dtype=torch.int32)
    bitmask[mask.rows] = mask.bitmask
    apply_token_bitmask(logits, bitmask, mask.rows)


def get_token_counts(
    padded_token_ids: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """[m, vocab] occurrence counts from [m, length] token ids padded with `vocab_size`."""
    counts = torch.zeros(
        padded_token_ids.shape[0], vocab_size + 1, dtype=dtype, device=padded_token_ids.device
    )
    counts.scatter_add_(1, padded_token_ids, torch.ones_like(padded_token_ids, dtype=dtype))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties on [m, vocab] logits.

    Repetition: a token seen in the prompt or the output has a positive logit divided by
    the penalty and a negative one multiplied by it. Frequency: minus penalty × its count
    in the output. Presence: minus penalty once if it occurs in the output at all.
    A penalty no row uses costs no pass over the vocabulary.
    """
    counts = get_token_counts(output_token_ids, logits.shape[-1], logits.dtype)
    output_mask = counts > 0
    if bool((repetition_penalties != 1.0).any()):
        seen = prompt_mask | output_mask
        factor = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0).to(logits.dtype)
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    if bool((frequency_penalties != 0.0).any()):
        logits = logits - frequency_penalties.unsqueeze(1).to(logits.dtype) * counts
    if bool((presence_penalties != 0.0).any()):
        logits = logits - presence_penalties.unsqueeze(1).to(logits.dtype) * output_mask
    return logits
