"""Prompt lookup: the longest matching suffix wins, its earliest occurrence, k tokens after."""

from __future__ import annotations

import numpy as np

from tokenserve.config import SpeculativeConfig
from tokenserve.spec_decode.ngram_proposer import NgramProposer


def proposer(low=1, high=3, k=3):
    return NgramProposer(SpeculativeConfig("ngram", k, prompt_lookup_min=low, prompt_lookup_max=high))


def propose(tokens, **kwargs):
    return proposer(**kwargs).propose(np.asarray(tokens, dtype=np.int64))


def test_the_tokens_after_the_earlier_occurrence_are_proposed():
    assert propose([1, 2, 3, 4, 5, 9, 1, 2]) == [3, 4, 5]
    assert propose([1, 2, 3, 4, 5, 9, 1, 2], k=2) == [3, 4]


def test_the_longest_suffix_wins_over_an_earlier_shorter_match():
    # "2" alone first occurs before 7; "1 2" occurs only before 8.
    assert propose([2, 7, 1, 2, 8, 6, 1, 2]) == [8, 6, 1]


def test_the_earliest_occurrence_of_the_suffix():
    assert propose([5, 1, 6, 5, 1, 7, 5, 1], low=2, high=2) == [6, 5, 1]


def test_no_match_no_drafts():
    assert propose([1, 2, 3, 4]) == []
    assert propose([1, 2, 3, 1], low=2, high=3) == []  # only "1" repeats
    assert propose([7]) == []


def test_proposals_stop_at_the_end_of_the_tokens():
    assert propose([4, 4]) == [4]
    assert propose([1, 2, 3, 1, 2], k=5) == [3, 1, 2]
