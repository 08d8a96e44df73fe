"""One request's structured-output state in the engine core: its grammar and progress.

The grammar arrives from the compile pool (a future); until then the request waits
(RequestStatus.WAITING_FOR_GRAMMAR). The matcher then moves with every token the request
accepts: tokens are accepted once, when sampled, so preemption and recompute (which
compute the same tokens again without sampling them) leave it as it is.

With `enforce_after_token_ids` (a reasoning model's end-of-reasoning marker) the grammar
sleeps until that token sequence appears in the output: no mask, nothing accepted.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # grammar.py imports xgrammar: loaded only once a grammar is compiled
    from tokenserve.structured_output.grammar import CompiledGrammar, GrammarMatcher

logger = logging.getLogger(__name__)


class StructuredOutputRequest:
    def __init__(
        self,
        grammar: Future[CompiledGrammar],
        stop_token_ids: list[int],
        enforce_after_token_ids: list[int] | None = None,
    ) -> None:
        self.grammar = grammar
        self.stop_token_ids = stop_token_ids
        self.enforce_after_token_ids = enforce_after_token_ids
        self.matcher: GrammarMatcher | None = None
        # Set when the grammar failed to compile.
        self.error: str | None = None
        self.enforcing = enforce_after_token_ids is None

    def poll_grammar(self) -> bool:
        """True once the grammar is compiled (or failed: see `error`); builds the matcher."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.grammar.done():
            return False
        try:
            self.matcher = self.grammar.result().new_matcher(self.stop_token_ids)
        except Exception as error:  # noqa: BLE001 - any compile failure ends only this request
            self.error = str(error) or type(error).__name__
        return True

    @property
    def constrains_next_token(self) -> bool:
        return self.enforcing and self.matcher is not None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into bitmask[row]; False if the row needs no mask."""
        if not self.constrains_next_token:
            return False
        assert self.matcher is not None
        return self.matcher.fill_bitmask(bitmask, row)

    def fill_bitmasks(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> list[int]:
        """Masks for a row and the rows after each of its `drafts` (speculative decoding),
        written from bitmask[row] on; returns the positions that needed one. The grammar
        walks the drafts and comes back: only sampled tokens are accepted for good."""
        if not self.constrains_next_token:
            return []
        assert self.matcher is not None
        positions = []
        num_accepted = 0
        for position in range(len(drafts) + 1):
            if self.matcher.is_terminated():
                break
            if self.matcher.fill_bitmask(bitmask, row + len(positions)):
                positions.append(position)
            if position == len(drafts) or not self.matcher.accept_token(drafts[position]):
                break  # rows after a draft the grammar refuses never count
            num_accepted += 1
        self.matcher.rollback(num_accepted)
        return positions

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The longest start of `drafts` the grammar accepts from where it is (none while
        the grammar sleeps: its position in the output is not known yet)."""
        if not self.constrains_next_token:
            return []
        assert self.matcher is not None
        num_accepted = 0
        for token_id in drafts:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
                break
            num_accepted += 1
        self.matcher.rollback(num_accepted)
        return drafts[:num_accepted]

    def accept_tokens(self, request_id: str, output_token_ids: list[int], num_new: int) -> None:
        """Advance the grammar over the last `num_new` tokens of `output_token_ids`."""
        assert self.matcher is not None, "a request is scheduled only once its grammar is ready"
        first_new: int | None = len(output_token_ids) - num_new
        if not self.enforcing:
            first_new = self._enforcing_start(output_token_ids, len(output_token_ids) - num_new)
            if first_new is None:
                return
            self.enforcing = True
        for token_id in output_token_ids[first_new:]:
            if not self.matcher.accept_token(token_id):
                # Only possible when something overrode the mask (e.g. min_tokens banning
                # the only allowed token, EOS): the grammar stays where it was.
                logger.warning(
                    "Request %s: token %d does not fit its grammar; it was not accepted.",
                    request_id,
                    token_id,
                )

    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def _enforcing_start(self, output_token_ids: list[int], first_new: int) -> int | None:
        """Index just past the marker if it ends among the new tokens, else None."""
        marker = self.enforce_after_token_ids
        assert marker is not None
        for end in range(max(first_new + 1, len(marker)), len(output_token_ids) + 1):
            if output_token_ids[end - len(marker) : end] == marker:
                return end
        return None
