"""Grammar bitmasks, penalties, logit bias, allowed tokens and bans equal direct per-row
references."""

from __future__ import annotations

import numpy as np
import torch

from tokenserve.sample.logits_processors import (
    AllowedTokens,
    BannedTokens,
    GrammarMask,
    LogitBias,
    LogitsProcessorInputs,
    Penalties,
    apply_logits_processors,
    apply_penalties,
    get_token_counts,
)

VOCAB = 50


def _reference_penalties(logits, prompt_ids, output_ids, presence, frequency, repetition):
    """vLLM's definition, one row and one token at a time."""
    result = logits.copy()
    for token in range(len(result)):
        count = output_ids.count(token)
        if token in prompt_ids or count > 0:
            if result[token] > 0:
                result[token] /= repetition
            else:
                result[token] *= repetition
        result[token] -= frequency * count
        if count > 0:
            result[token] -= presence
    return result


def _padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [VOCAB] * (width - len(r)) for r in rows])


def test_penalties_equal_reference():
    rng = np.random.default_rng(0)
    num_rows = 6
    logits = rng.normal(0, 3, size=(num_rows, VOCAB)).astype(np.float32)
    prompts = [rng.integers(0, VOCAB, rng.integers(1, 20)).tolist() for _ in range(num_rows)]
    outputs = [rng.integers(0, VOCAB, rng.integers(0, 30)).tolist() for _ in range(num_rows)]
    outputs[0] = []  # a row with no output yet
    presence = rng.uniform(-2, 2, num_rows).astype(np.float32)
    frequency = rng.uniform(-2, 2, num_rows).astype(np.float32)
    repetition = rng.uniform(0.5, 2, num_rows).astype(np.float32)
    repetition[1] = 1.0

    prompt_mask = torch.zeros(num_rows, VOCAB, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        prompt_mask[row, prompt] = True
    ours = apply_penalties(
        torch.from_numpy(logits),
        prompt_mask,
        _padded(outputs),
        torch.from_numpy(presence),
        torch.from_numpy(frequency),
        torch.from_numpy(repetition),
    )
    for row in range(num_rows):
        expected = _reference_penalties(
            logits[row], prompts[row], outputs[row], presence[row], frequency[row], repetition[row]
        )
        np.testing.assert_allclose(ours[row].numpy(), expected, rtol=1e-6, atol=1e-5)


def test_token_counts_drop_padding():
    counts = get_token_counts(torch.tensor([[1, 1, 3, VOCAB, VOCAB], [VOCAB] * 5]), VOCAB)
    assert counts.shape == (2, VOCAB)
    assert counts[0, 1] == 2 and counts[0, 3] == 1 and counts[0].sum() == 3
    assert counts[1].sum() == 0


def test_processors_touch_only_their_rows():
    rng = np.random.default_rng(1)
    logits = torch.from_numpy(rng.normal(size=(4, VOCAB)).astype(np.float32))
    original = logits.clone()
    allowed_mask = torch.zeros(1, VOCAB, dtype=torch.bool)
    allowed_mask[0, [3, 7]] = True
    inputs = LogitsProcessorInputs(
        allowed=AllowedTokens(torch.tensor([0]), allowed_mask),
        banned=BannedTokens(torch.tensor([1, 1]), torch.tensor([5, 9])),
        logit_bias=LogitBias(torch.tensor([2, 2]), torch.tensor([4, 8]), torch.tensor([1.5, -3.0])),
        penalties=Penalties(
            rows=torch.tensor([3]),
            output_token_ids=torch.tensor([[2, 2]]),
            prompt_mask=torch.zeros(1, VOCAB, dtype=torch.bool),
            presence=torch.tensor([0.5]),
            frequency=torch.tensor([0.25]),
            repetition=torch.tensor([1.0]),
        ),
    )
    result = apply_logits_processors(logits.clone(), inputs)

    expected = original.clone()
    expected[0, [t for t in range(VOCAB) if t not in (3, 7)]] = float("-inf")
    expected[1, [5, 9]] = float("-inf")
    expected[2, 4] += 1.5
    expected[2, 8] -= 3.0
    expected[3, 2] -= 0.5 + 2 * 0.25
    torch.testing.assert_close(result, expected)


def test_grammar_mask_applies_its_bits_to_its_rows_only():
    vocab = 70  # not a multiple of 32: the last word is partly padding
    rng = np.random.default_rng(2)
    logits = torch.from_numpy(rng.normal(size=(5, vocab)).astype(np.float32))
    allowed = rng.random((2, vocab)) < 0.3
    bitmask = np.zeros((2, (vocab + 31) // 32), dtype=np.uint32)
    for row, token in zip(*np.nonzero(allowed)):
        bitmask[row, token // 32] |= np.uint32(1 << (token % 32))
    rows = [3, 1]
    inputs = LogitsProcessorInputs(
        grammar=GrammarMask(rows, torch.from_numpy(bitmask.view(np.int32)))
    )
    result = apply_logits_processors(logits.clone(), inputs)

    expected = logits.clone()
    for index, row in enumerate(rows):
        expected[row, torch.from_numpy(~allowed[index])] = float("-inf")
    torch.testing.assert_close(result, expected)
