"""`speculative_config` (a dict with vLLM's keys, or its JSON on the command line) → a
validated `SpeculativeConfig` (config.py), before any weight is read."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from tokenserve.config import SPECULATIVE_METHODS, ModelConfig, SpeculativeConfig
from tokenserve.model.loader import resolve_model

# vLLM's defaults when neither prompt_lookup bound is given.
DEFAULT_PROMPT_LOOKUP = 5
KNOWN_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
)


def parse_speculative_config_json(text: str) -> dict[str, Any]:
    """`--speculative-config '{"method": "ngram", ...}'` → its dict (ValueError if not one)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--speculative-config must be a JSON object: {error}.") from None
    if not isinstance(value, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {text!r}.")  # noqa: TRY004
    return value


def create_speculative_config(
    values: dict[str, Any] | None, target: ModelConfig
) -> SpeculativeConfig | None:
    """Validate `values` against the target model; None (or {}) turns speculation off."""
    if not values:
        return None
    if not isinstance(values, dict):
        raise ValueError(  # noqa: TRY004
            f"speculative_config must be a dict, got {type(values).__name__}."
        )
    unknown = sorted(set(values) - set(KNOWN_KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config has unknown keys {unknown}; known: {list(KNOWN_KEYS)}."
        )
    method = _method(values)
    k = values.get("num_speculative_tokens")
    if _not_int(k) or k < 1:
        raise ValueError(
            f"speculative_config: num_speculative_tokens must be a positive integer, got {k!r}."
        )
    limit = values.get("disable_by_batch_size")
    if limit is not None and (_not_int(limit) or limit < 1):
        raise ValueError(
            "speculative_config: disable_by_batch_size must be a positive integer, "
            f"got {limit!r}."
        )
    config = SpeculativeConfig(method, k, disable_by_batch_size=limit)
    if method == "ngram":
        return _with_ngram_bounds(config, values)
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if values.get(key) is not None:
            raise ValueError(f"speculative_config: {key} applies to method 'ngram' only.")
    return replace(config, draft_model_config=_draft_model_config(values.get("model"), target))


def _method(values: dict[str, Any]) -> str:
    method = values.get("method")
    model = values.get("model")
    if method is None:
        # As vLLM: model "ngram" names the method, any other model is a draft model.
        if model is None:
            raise ValueError("speculative_config needs 'method' ('ngram' or 'draft_model').")
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative_config: method must be one of {list(SPECULATIVE_METHODS)}, "
            f"got {method!r}."
        )
    return method


def _with_ngram_bounds(config: SpeculativeConfig, values: dict[str, Any]) -> SpeculativeConfig:
    low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    low = high if low is None else low
    high = low if high is None else high
    for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if _not_int(value) or value < 1:
            raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}.")
    if low > high:
        raise ValueError(
            f"speculative_config: prompt_lookup_min ({low}) must not exceed "
            f"prompt_lookup_max ({high})."
        )
    if values.get("model") not in (None, "ngram", "[ngram]"):
        raise ValueError("speculative_config: method 'ngram' takes no draft model.")
    return replace(config, prompt_lookup_min=low, prompt_lookup_max=high)


def _draft_model_config(model: Any, target: ModelConfig) -> ModelConfig:
    if not isinstance(model, str) or not model:
        raise ValueError("speculative_config: method 'draft_model' needs 'model', a path.")
    files = resolve_model(model)
    hf_config = files.hf_config
    if hf_config.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({hf_config.vocab_size} tokens) "
            f"differs from the target's ({target.vocab_size}); a draft model must share the "
            "target's tokenizer."
        )
    limit = getattr(hf_config, "max_position_embeddings", None) or target.max_model_len
    if limit < target.max_model_len:
        raise ValueError(
            f"speculative_config: the draft model supports {limit} positions, fewer than "
            f"max_model_len ({target.max_model_len}); lower max_model_len."
        )
    return ModelConfig(
        model=files.path,
        format=files.format,
        architecture=files.architecture,
        hf_config=hf_config,
        dtype=target.dtype,
        max_model_len=target.max_model_len,
        files=files,
        seed=target.seed,
        disable_cascade_attn=target.disable_cascade_attn,
    )


def _not_int(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)
