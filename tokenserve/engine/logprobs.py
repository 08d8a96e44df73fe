"""Engine-core logprob lists → the user's `{token_id: Logprob}` dicts, with decoded tokens."""

from __future__ import annotations

from tokenserve.messages.engine_core import LogprobsLists
from tokenserve.outputs import Logprob, LogprobsDict


class LogprobsDecoder:
    """Builds Logprob dicts; each token's text is decoded once and remembered."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def to_dicts(self, lists: LogprobsLists) -> list[LogprobsDict]:
        """One dict per position: the chosen token first, then the top-k (ranks 1..k)."""
        dicts = []
        for token_ids, logprobs, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            chosen = token_ids[0]
            entries = {chosen: Logprob(logprobs[0], rank, self.token_text(chosen))}
            for top_rank, (token_id, logprob) in enumerate(zip(token_ids[1:], logprobs[1:]), 1):
                if token_id not in entries:
                    entries[token_id] = Logprob(logprob, top_rank, self.token_text(token_id))
            dicts.append(entries)
        return dicts
