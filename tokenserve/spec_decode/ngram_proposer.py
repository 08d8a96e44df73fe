"""N-gram (prompt lookup) proposals: where the last n tokens of a request occurred before
in its own tokens (prompt and output), propose the k tokens that followed them there.

The longest n in [prompt_lookup_min, prompt_lookup_max] that matches wins; among its
matches the earliest, as vLLM does. No model, no state: a proposal depends only on the
request's tokens, so it is deterministic and its verification exact as a point mass.
"""

from __future__ import annotations

import numpy as np

from tokenserve.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.k = config.num_speculative_tokens

    def propose(self, token_ids: np.ndarray, k: int | None = None) -> list[int]:
        """Up to `k` (default num_speculative_tokens) drafts to follow `token_ids`."""
        k = self.k if k is None else k
        num_tokens = len(token_ids)
        if k <= 0:
            return []
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            start = find_earliest(token_ids, n)
            if start is not None:
                follow = start + n
                return token_ids[follow : follow + k].tolist()
        return []


def find_earliest(token_ids: np.ndarray, n: int) -> int | None:
    """The first start of the last `n` tokens' earlier occurrence (not the suffix itself)."""
    num_tokens = len(token_ids)
    suffix = token_ids[num_tokens - n :]
    # Candidate starts where the first token matches, before the suffix's own start.
    candidates = np.flatnonzero(token_ids[: num_tokens - n] == suffix[0])
    for start in candidates.tolist():
        if np.array_equal(token_ids[start : start + n], suffix):
            return start
    return None
