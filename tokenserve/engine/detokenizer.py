"""Incremental detokenization of one request: token ids → text, stop strings, hold-back.

Text is decoded over a small sliding window (prefix offset / read offset): the window's
text minus the text of its first part is what the newest tokens add. A token that ends
in the middle of a UTF-8 character (byte-level BPE pieces of emoji or CJK) decodes to
"\ufffd"; nothing is emitted until a later token completes the character, so deltas never
split one. A character still incomplete when the request finishes (max_tokens cut it) is
dropped, not replaced: the final text never ends in a "\ufffd" of its own making. The window starts a few prompt tokens back, so the first generated token
decodes with its context (a leading space stays a space).

With skip_special_tokens=False the text equals the tokenizer's own decode, as vLLM's
fast-tokenizer path gives; spaces_between_special_tokens=False additionally drops any
separator the decoder would put between two adjacent added tokens.

Stop strings are searched for in the newly decoded text plus the (longest stop − 1)
characters before it, so they are found across token boundaries. While the text ends in
something that could still grow into a stop string, those characters are held back
(unless include_stop_str_in_output, where nothing can be cut from sent text).
"""

from __future__ import annotations

from tokenserve.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the first generated one (their text is not output).
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.output_text = ""
        self.num_output_tokens = 0
        # Chars of output_text already handed out as deltas.
        self._num_sent_chars = 0

        self._added_tokens: dict[int, str] = {}
        if not params.spaces_between_special_tokens and not params.skip_special_tokens:
            self._added_tokens = {
                token_id: str(token) for token_id, token in _added_tokens_decoder(tokenizer).items()
            }
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        if self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []  # The prompt ends inside a character: no context beats a wrong one.
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)

    def update(self, new_token_ids: list[int], finished: bool, stop_terminated: bool) -> str | None:
        """Decode the step's new tokens; returns the stop string that ends the text, if any.

        `stop_terminated`: the engine core ended the request on a stop token (EOS or
        stop_token_ids), whose text is left out unless include_stop_str_in_output.
        """
        num_chars_before = len(self.output_text)
        self.num_output_tokens += len(new_token_ids)
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        for token_id in new_token_ids:
            self.output_text += self._decode_next(token_id)
        if finished:
            self.output_text += self._flush()
        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        return self._truncate_at_stop_string(len(self.output_text) - num_chars_before)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to hand out now: everything, or only what is new since the last call."""
        end = len(self.output_text) if finished else len(self.output_text) - self._num_held_back()
        if not delta:
            return self.output_text[:end]
        start = self._num_sent_chars
        self._num_sent_chars = max(start, end)
        return self.output_text[start:end]

    # ---- decoding ------------------------------------------------------------------

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_next(self, token_id: int) -> str:
        previous = self._ids[-1] if self._ids else None
        self._ids.append(token_id)
        if token_id in self._added_tokens and previous in self._added_tokens:
            # Two added tokens in a row: their literal text, no separator between them.
            self._restart_window()
            return self._added_tokens[token_id]
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            return ""  # Nothing yet, or a character is still incomplete.
        new_text = text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return new_text

    def _flush(self) -> str:
        """At the end: whatever the window still holds, less a trailing incomplete character
        (its bytes would decode to "\ufffd"; as vLLM, the text ends before it)."""
        text = self._decode(self._ids[self._prefix_offset :])
        new_text = text[len(self._prefix_text) :].rstrip(_REPLACEMENT_CHAR)
        self._restart_window()
        return new_text

    def _restart_window(self) -> None:
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = ""

    # ---- stop strings --------------------------------------------------------------

    def _truncate_at_stop_string(self, num_new_chars: int) -> str | None:
        if num_new_chars <= 0:
            return None
        text = self.output_text
        found: tuple[int, str] | None = None
        for stop in self.stop:
            # A match must end in the new text; it may start up to len(stop) - 1 before it.
            index = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
            if index != -1 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return None
        index, stop = found
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = text[:end]
        return stop

    def _num_held_back(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop string."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        text = self.output_text
        held = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:length]):
                    held = length
                    break
        return held


def _added_tokens_decoder(tokenizer) -> dict:
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    return dict(decoder) if decoder else {}
