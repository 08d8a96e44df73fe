"""Grammars for structured outputs, on xgrammar: specs, compiling, per-request matchers.

This is the only file that talks to xgrammar (docs/STRUCTURED_OUTPUTS.md says why xgrammar).
A grammar is built in two stages:
- `build_grammar(spec)`: the spec as a grammar, without the vocabulary (~1 ms). The
  Processor calls it through `check_structured_outputs` to refuse a bad schema, regex or
  grammar at the edge, with a ValueError that names the problem.
- `GrammarCompiler.compile(spec)`: that grammar compiled for the model's vocabulary (token
  masks precomputed: 1–100 ms). The engine core runs this in its thread pool.
A `GrammarMatcher` is one request's position in its grammar: it fills the request's row
of the step's token bitmask and accepts each sampled token.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from tokenserve.sampling_params import StructuredOutputsParams

# xgrammar prefixes some messages with "[hh:mm:ss] /path/file.cc:123: "; users need only the rest.
_XGRAMMAR_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")

_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile, as plain text: the compile cache's key."""

    kind: str  # json, json_object, regex, choice, grammar
    text: str  # the schema's JSON, the regex, the choices' JSON list, the grammar
    any_whitespace: bool = True

    @classmethod
    def from_params(cls, params: StructuredOutputsParams) -> GrammarSpec:
        kind = params.kind
        value: Any = getattr(params, kind)
        if kind == "json_object":
            text = ""
        elif kind == "json" and not isinstance(value, str):
            text = json.dumps(value)  # key order matters: it is the order properties are generated
        elif kind == "choice":
            text = json.dumps(value, ensure_ascii=False)
        else:
            text = value
        return cls(kind, text, not params.disable_any_whitespace)


def build_grammar(spec: GrammarSpec) -> xgr.Grammar:
    """The spec as an xgrammar Grammar; ValueError (naming the problem) if it is invalid."""
    try:
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(spec.text, any_whitespace=spec.any_whitespace)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=spec.any_whitespace
            )
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "choice":
            # Each choice as a string literal; JSON's escapes are EBNF's.
            literals = (json.dumps(c, ensure_ascii=False) for c in json.loads(spec.text))
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(literals))
        if spec.kind == "grammar":
            if "::=" in spec.text:
                return xgr.Grammar.from_ebnf(spec.text)
            return xgr.Grammar.from_lark(spec.text)
    except (RuntimeError, ValueError, TypeError) as error:
        raise ValueError(
            f"Invalid {_KIND_NAMES[spec.kind]} in structured_outputs: {_message(error)}"
        ) from None
    raise ValueError(f"Unknown structured output kind {spec.kind!r}.")


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raise a ValueError naming the problem if the spec cannot be compiled."""
    _check_spec(GrammarSpec.from_params(params))


@functools.lru_cache(maxsize=256)
def _check_spec(spec: GrammarSpec) -> None:
    # Valid specs are remembered (a server sees the same schema again and again); an
    # invalid one raises, and lru_cache does not keep exceptions.
    build_grammar(spec)


def _message(error: Exception) -> str:
    lines = [_XGRAMMAR_LOCATION.sub("", line).rstrip() for line in str(error).strip().splitlines()]
    return "\n".join(line for line in lines if line) or type(error).__name__


class GrammarCompiler:
    """Compiles specs for one vocabulary. Thread-safe: the manager calls it from its pool."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_threads: int = 1) -> None:
        # vocab_size is the model's (its logits' width), which may pad the tokenizer's.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads, cache_enabled=False
        )

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        return CompiledGrammar(self._compiler.compile_grammar(build_grammar(spec)))


class CompiledGrammar:
    """A grammar compiled for the vocabulary; shared by every request with the same spec."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._compiled = compiled

    def new_matcher(self, stop_token_ids: list[int]) -> GrammarMatcher:
        return GrammarMatcher(self._compiled, stop_token_ids)


class GrammarMatcher:
    """One request's state in its grammar.

    A stop token (the request's EOS) is allowed only where the grammar is complete;
    accepting it terminates the matcher.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int]) -> None:
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into bitmask[row]; False if every token is allowed."""
        return self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (drafts walked, not sampled)."""
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set logits[r, t] to -inf where bit t of bitmask[r] is 0, for each r in rows only.

    `bitmask` is [num_rows, ceil(vocab / 32)] int32 (token t is bit t % 32 of word t // 32).
    """
    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device), vocab_size=logits.shape[-1], indices=rows
    )
