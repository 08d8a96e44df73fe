"""The rejection sampler: greedy rows give the argmax run; random rows give new tokens
distributed exactly as the target's distribution, whatever the proposal.

Statistics: chi-square goodness of fit against the exact distribution, each test at a
p-value threshold of 1e-3 (a false-alarm rate of 0.1 % per test for an exact sampler), with
a fixed seed, so each run draws the same samples and the result is deterministic anyway.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from tokenserve.sample.rejection_sampler import RejectionSampler, accept_random
from tokenserve.sample.sampler import SamplingMetadata

P_VALUE_THRESHOLD = 1e-3
VOCAB = 5
# The target's distributions at two positions, and a proposal that disagrees with both.
TARGET = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.05, 0.3, 0.3, 0.3]])
PROPOSAL = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.4, 0.1, 0.1, 0.2, 0.2]])
NUM_TRIALS = 12_000


def metadata(greedy: list[bool], generators=None) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.ones(len(greedy)),
        greedy=torch.tensor(greedy),
        all_greedy=all(greedy),
        top_k=None,
        top_p=None,
        generators=generators or {},
    )


def test_greedy_rows_accept_while_the_argmax_agrees():
    logits = torch.full((7, VOCAB), -1.0)
    for row, token in enumerate([3, 1, 4, 2, 0, 2, 1]):
        logits[row, token] = 1.0
    # Request 0: drafts [3, 1] then bonus 4; request 1: drafts [9, 9] rejected at once (2);
    # request 2: no drafts.
    output = RejectionSampler()(logits, metadata([True] * 7), [[3, 1], [0, 2], []])
    assert output.new_token_ids == [[3, 1, 4], [2], [1]]


def _first_two_tokens(proposal: torch.Tensor | None, seed: int) -> torch.Tensor:
    """Counts of the first two new tokens over NUM_TRIALS runs of one request with drafts
    drawn from `proposal` (a point mass on token 1 then 2 when None)."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.cat([TARGET, TARGET[1:]])  # position 2's target: the bonus token's
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(NUM_TRIALS):
        if proposal is None:
            drafts = [1, 2]
        else:
            drafts = [int(torch.multinomial(proposal[i], 1, generator=generator)) for i in (0, 1)]
        tokens = accept_random(drafts, probs, proposal, generator)
        first = tokens[0]
        # A run that stopped after one token continues as the next step would: from p_1.
        second = tokens[1] if len(tokens) > 1 else int(
            torch.multinomial(TARGET[1], 1, generator=generator)
        )
        counts[first, second] += 1
    return counts.flatten()


@pytest.mark.parametrize("proposal", [None, PROPOSAL], ids=["point-mass", "draft-distribution"])
def test_random_rows_are_distributed_as_the_target(proposal):
    counts = _first_two_tokens(proposal, seed=0)
    # Position 1's target does not depend on the first token here: the joint is a product.
    expected = torch.outer(TARGET[0], TARGET[1]).flatten() * NUM_TRIALS
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > P_VALUE_THRESHOLD


def test_the_chi_square_test_has_power():
    """A biased sampler (every draft accepted) fails the same test."""
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(VOCAB)
    for _ in range(2_000):
        counts[int(torch.multinomial(PROPOSAL[0], 1, generator=generator))] += 1
    assert chisquare(counts.numpy(), (TARGET[0] * 2_000).numpy()).pvalue < P_VALUE_THRESHOLD


def test_a_draft_the_target_excludes_is_never_accepted():
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    for _ in range(50):
        assert accept_random([0], probs, None, generator) == [1]
        assert accept_random([1], probs, None, generator) == [1, 2]


def test_a_seeded_row_is_reproducible():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))

    def run(seed: int) -> list[list[int]]:
        generators = {0: torch.Generator().manual_seed(seed)}
        return RejectionSampler()(logits, metadata([False] * 3, generators), [[1, 2]]).new_token_ids

    draws = [run(7) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]
    assert len({tuple(run(seed)[0]) for seed in range(20)}) > 1
