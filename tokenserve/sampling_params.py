"""Sampling parameters of one request: what to sample and when to stop.

Names, meanings and defaults follow vLLM's `SamplingParams`. Validation happens here,
at the edge, so that a bad value never reaches the engine core; what needs the
tokenizer or the vocabulary (token ids in range, `bad_words` → token ids) is checked by
the Processor. The class stays a plain dataclass of msgspec-encodable fields: a server
ships it to the engine-core process as it is.
"""

from __future__ import annotations

import enum
import json as json_module
from dataclasses import dataclass, field
from typing import Any

# Below this temperature a request is treated as greedy (argmax), as in vLLM.
_GREEDY_EPSILON = 1e-5
# vLLM clamps logit_bias values to this range.
_MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.IntEnum):
    """Which RequestOutputs a request yields while it runs."""

    CUMULATIVE = 0  # every step: everything generated so far
    DELTA = 1  # every step: only what is new since the last output
    FINAL_ONLY = 2  # once, when the request finishes


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a grammar (vLLM's names; exactly one kind is set).

    - `json`: a JSON schema (a dict, or a string holding one); the output is a JSON value
      valid under it.
    - `json_object=True`: any JSON object.
    - `regex`: the whole output matches the regular expression.
    - `choice`: the output is exactly one of these strings.
    - `grammar`: a context-free grammar, in EBNF (GBNF, with a `root` rule) or Lark syntax
      (with a `start` rule).

    `disable_any_whitespace` makes JSON compact: no whitespace beyond the separators
    `", "` and `": "` (otherwise any amount is allowed between tokens, which a small model
    may fill with newlines).

    `enforce_after_token_ids` is for reasoning models: the grammar constrains only what
    follows the first occurrence of this token sequence in the output (the reasoning
    parser's end marker, e.g. the ids of `</think>`); None constrains from the first token.

    Is the spec well formed? The Processor compiles it (without the vocabulary) and raises
    a ValueError that names the problem; the engine core compiles it for the vocabulary.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    enforce_after_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        kinds = [
            name for name in _STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False)
        ]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice or "
                f"grammar; got {', '.join(kinds) if kinds else 'none'}."
            )
        if isinstance(self.json, str):
            try:
                schema = json_module.loads(self.json)
            except json_module.JSONDecodeError as error:
                raise ValueError(f"structured_outputs.json is not valid JSON: {error}.") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(
                    "structured_outputs.json must be a JSON schema (an object), "
                    f"got {type(schema).__name__}."
                )
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(
                "structured_outputs.json must be a JSON schema (a dict or a JSON string), "
                f"got {type(self.json).__name__}."
            )
        if self.json_object not in (None, True, False):
            raise ValueError(
                f"structured_outputs.json_object must be a bool, got {self.json_object!r}."
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")
        if self.choice is not None:
            self.choice = list(self.choice)
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError(
                    "structured_outputs.choice must be a non-empty list of non-empty strings, "
                    f"got {self.choice!r}."
                )
        if self.enforce_after_token_ids is not None:
            self.enforce_after_token_ids = list(self.enforce_after_token_ids)
            if not self.enforce_after_token_ids:
                raise ValueError(
                    "structured_outputs.enforce_after_token_ids must be None or a non-empty "
                    "list of token ids."
                )
            _check_token_ids(
                "structured_outputs.enforce_after_token_ids", self.enforce_after_token_ids
            )

    @property
    def kind(self) -> str:
        """Which of json, json_object, regex, choice, grammar is set."""
        return next(n for n in _STRUCTURED_OUTPUT_KINDS if getattr(self, n) not in (None, False))


_STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class SamplingParams:
    """How to sample the tokens of one request and when to stop.

    `temperature=0` means greedy. `top_k=0` or `-1` disables top-k, `top_p=1` disables
    top-p, `min_p=0` disables min-p. Penalties: `presence_penalty` and
    `frequency_penalty` (in [-2, 2]) subtract from the logits of tokens already
    generated, once or per occurrence; `repetition_penalty` (> 0, 1 = off) divides
    positive and multiplies negative logits of tokens in the prompt or the output.
    `stop` strings end generation and are cut from the text unless
    `include_stop_str_in_output`. `logprobs=k` returns, per generated token, its own
    logprob plus the top-k alternatives; `prompt_logprobs=k` does the same for the prompt.
    Logprobs are the model's raw ones, before temperature, penalties and masks.
    `max_tokens=None` generates until a stop or `max_model_len`.
    `structured_outputs` constrains the output to a JSON schema, a regex, a choice or a
    grammar (see StructuredOutputsParams); a request whose grammar is complete ends with
    finish_reason "stop".
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Arguments for extensions (vLLM's field); "kv_transfer_params" reaches a KV connector.
    extra_args: dict[str, Any] | None = None
    # Set by the Processor from `bad_words` (each word as one or more token sequences);
    # the engine core only ever reads this one.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        self.output_kind = RequestOutputKind(self.output_kind)
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as error:
                raise ValueError(f"structured_outputs: {error}.") from None
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(
                "repetition_penalty must be greater than 0 (1 disables it), "
                f"got {self.repetition_penalty}."
            )
        if not self.temperature >= 0.0:
            raise ValueError(
                f"temperature must be non-negative (0 = greedy), got {self.temperature}."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(
                f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}."
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if value < 0:
                    raise ValueError(f"{name} must be None or a non-negative integer, got {value}.")
        if any(not isinstance(s, str) or not s for s in self.stop or []):
            raise ValueError(
                f"stop must be a string or a list of non-empty strings, got {self.stop!r}."
            )
        _check_token_ids("stop_token_ids", self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be None or a non-empty list of token ids.")
            _check_token_ids("allowed_token_ids", self.allowed_token_ids)
        if self.bad_words is not None and any(
            not isinstance(w, str) or not w.strip() for w in self.bad_words
        ):
            raise ValueError(
                f"bad_words must be a list of non-empty strings, got {self.bad_words!r}."
            )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams (or a dict of its "
                f"fields), got {type(self.structured_outputs).__name__}."
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}.")


def _check_token_ids(name: str, token_ids: list[int]) -> None:
    for token_id in token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"{name} must be non-negative integer token ids, got {token_id!r}.")


def _normalize_logit_bias(logit_bias: dict) -> dict[int, float]:
    """Integer keys (JSON gives strings) and values clamped to [-100, 100], as vLLM does."""
    normalized = {}
    for key, value in logit_bias.items():
        try:
            token_id = int(key)
            bias = float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"logit_bias must map token ids to numbers, got {key!r}: {value!r}."
            ) from None
        if token_id < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {token_id}.")
        normalized[token_id] = max(-_MAX_LOGIT_BIAS, min(_MAX_LOGIT_BIAS, bias))
    return normalized
