"""Measure the grammar engines tokenserve could use for structured outputs.

For each candidate (xgrammar, llguidance) on the default model's tokenizer (SmolLM2,
49152 tokens): the one-off tokenizer setup, the compile time of each kind of spec
(JSON schemas, any JSON, regex, choice, a Lark grammar), and the per-step cost of a
decode: fill one row's token bitmask, then accept the sampled token, walking through the
tokens of a valid output. Also the cost of applying a bitmask to a batch of logits rows.

    pip install llguidance    # the candidate not in tokenserve's dependencies
    python benchmarks/structured_output_backends.py --repeat 5

Numbers are wall-clock on this machine; docs/STRUCTURED_OUTPUTS.md records a run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tokenserve.model.loader import load_tokenizer, resolve_model

# (name, kind, spec, a valid output whose tokens drive the per-step measurement)
CASES: list[tuple[str, str, Any, str]] = [
    (
        "json: flat object",
        "json",
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        '{"name": "Ada Lovelace", "age": 36}',
    ),
    (
        "json: nested + arrays + enum",
        "json",
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "status": {"enum": ["pending", "shipped", "delivered"]},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 5,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                            "price": {"type": "number", "minimum": 0},
                        },
                        "required": ["sku", "quantity", "price"],
                    },
                },
                "customer": {
                    "type": "object",
                    "properties": {
                        "email": {"type": "string", "format": "email"},
                        "vip": {"type": "boolean"},
                    },
                    "required": ["email"],
                },
            },
            "required": ["order_id", "status", "items", "customer"],
        },
        (
            '{"order_id": "ABC-1234", "status": "shipped", "items": [{"sku": "x-1", '
            '"quantity": 2, "price": 9.99}, {"sku": "y-2", "quantity": 1, "price": 120}], '
            '"customer": {"email": "ada@example.com", "vip": true}}'
        ),
    ),
    (
        "json: string patterns + bounds",
        "json",
        {
            "type": "object",
            "properties": {
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "phone": {"type": "string", "pattern": "^\\+[0-9]{1,3} [0-9]{3}-[0-9]{4}$"},
                "score": {"type": "number", "minimum": 0, "maximum": 10},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}},
            },
            "required": ["date", "phone", "score", "tags"],
        },
        '{"date": "2024-03-01", "phone": "+44 555-0101", "score": 7.5, "tags": ["a", "bc"]}',
    ),
    (
        "json_object (any JSON)",
        "json_object",
        None,
        '{"answer": [1, 2, {"deep": null}], "ok": true, "text": "hello world"}',
    ),
    ("regex: date", "regex", r"\d{4}-\d{2}-\d{2}", "2025-07-14"),
    ("choice", "choice", ["positive", "negative", "neutral"], "negative"),
    (
        "grammar: arithmetic (Lark)",
        "grammar",
        """
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
""",
        "(12+3)*4-5/6",
    ),
]


def _timed(function: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - started


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.info, self.setup_s = _timed(
            lambda: xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        )
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec: Any):
        # A fresh compiler each time: xgrammar caches compiled grammars per compiler.
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=2)
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(spec))
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_regex("|".join(_escape_regex(c) for c in spec))
        return compiler.compile_lark(spec)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.llg_torch = llguidance.torch
        self.tokenizer, self.setup_s = _timed(
            lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        )

    def compile(self, kind: str, spec: Any):
        llg = self.llg
        if kind == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(spec))
        elif kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}')
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            grammar = llg.grammar_from("choice", json.dumps(spec))
        else:
            grammar = llg.LLMatcher.grammar_from_lark(spec)
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        # llguidance compiles lazily, when a matcher is built: building one is the compile.
        self.matcher(grammar)
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tokenizer, grammar)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        self.llg_torch.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


def _escape_regex(text: str) -> str:
    import re

    return re.escape(text)


def _micros(values: list[float]) -> str:
    values = sorted(values)
    p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
    return f"{1e6 * statistics.mean(values):8.1f} {1e6 * values[len(values) // 2]:8.1f} {1e6 * p99:8.1f}"


def measure_backend(backend, tokenizer, vocab_size: int, repeat: int) -> None:
    print(f"\n== {backend.name}: tokenizer setup {1e3 * backend.setup_s:.0f} ms")
    print(
        f"{'case':32} {'compile ms':>10} {'tokens':>6}   fill µs mean/p50/p99        accept µs mean/p50/p99"
    )
    bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for name, kind, spec, example in CASES:
        compile_times = []
        compiled = None
        for _ in range(repeat):
            compiled, seconds = _timed(backend.compile, kind, spec)
            compile_times.append(seconds)
        token_ids = tokenizer.encode(example, add_special_tokens=False)
        fill_times, accept_times = [], []
        for _ in range(repeat):
            matcher = backend.matcher(compiled)
            for token in token_ids:
                _, seconds = _timed(backend.fill, matcher, bitmask, 0)
                fill_times.append(seconds)
                accepted, seconds = _timed(backend.accept, matcher, token)
                accept_times.append(seconds)
                if not accepted:
                    raise RuntimeError(f"{backend.name} rejected token {token} of {example!r}")
        print(
            f"{name:32} {1e3 * statistics.median(compile_times):10.1f} {len(token_ids):6d}   "
            f"{_micros(fill_times)}   {_micros(accept_times)}"
        )


def apply_with_torch_ops(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    shifts = torch.arange(32, dtype=torch.int32)
    index = torch.tensor(rows)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(len(rows), -1)
    masked = logits[index].masked_fill(~allowed[:, : logits.shape[1]], float("-inf"))
    logits[index] = masked


def apply_with_xgrammar(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """What the sampler does (tokenserve.sample.logits_processors.apply_grammar_mask)."""
    import xgrammar

    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgrammar.apply_token_bitmask_inplace(logits, full, indices=rows)


def measure_apply(vocab_size: int, repeat: int) -> None:
    """Applying bitmasks to a batch's logits rows: xgrammar's CPU kernel (what the sampler
    uses) vs unpacking the bits with torch ops. llguidance's own helper is torch.compile'd,
    which on CPU needs a C++ toolchain at run time, so it is not a candidate here."""
    print("\n== applying bitmasks to logits rows (µs per step, median)")
    words = (vocab_size + 31) // 32
    generator = torch.Generator().manual_seed(0)
    for num_rows, num_masked in ((8, 1), (8, 8), (32, 8), (32, 32)):
        logits = torch.randn(num_rows, vocab_size, generator=generator)
        rows = list(range(0, num_rows, num_rows // num_masked))
        bitmask = torch.randint(
            -(2**31), 2**31 - 1, (num_masked, words), dtype=torch.int32, generator=generator
        )
        line = f"  {num_masked:2d} of {num_rows:2d} rows masked:"
        for name, function in (
            ("torch ops", apply_with_torch_ops),
            ("xgrammar", apply_with_xgrammar),
        ):
            function(logits, bitmask, rows)
            times = [_timed(function, logits, bitmask, rows)[1] for _ in range(max(repeat, 20))]
            line += f"   {name} {1e6 * statistics.median(times):8.1f}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--backend", choices=["xgrammar", "llguidance", "both"], default="both")
    args = parser.parse_args()
    torch.set_num_threads(2)
    files = resolve_model(None)
    tokenizer = load_tokenizer(files)
    vocab_size = files.hf_config.vocab_size
    backends = {"xgrammar": XGrammarBackend, "llguidance": LLGuidanceBackend}
    names = list(backends) if args.backend == "both" else [args.backend]
    for name in names:
        try:
            backend = backends[name](tokenizer, vocab_size)
        except ImportError:
            print(f"\n== {name}: not installed (pip install {name}); skipped")
            continue
        measure_backend(backend, tokenizer, vocab_size, args.repeat)
    measure_apply(vocab_size, args.repeat)


if __name__ == "__main__":
    main()
