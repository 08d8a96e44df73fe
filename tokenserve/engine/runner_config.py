"""The runner a model runs under (vLLM's `--runner`): "generate", or "pooling" with the
tasks, pooling and limits that follow from the model's architecture and directory."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from tokenserve.config import RUNNERS, ModelConfig, PoolerConfig
from tokenserve.model.architectures import check_architecture, model_class_for, resolve_runner
from tokenserve.model.pooler import check_pooling_type, read_pooler_config

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RunnerSettings:
    """What the runner changes in the engine's other settings."""

    enable_chunked_prefill: bool
    enable_prefix_caching: bool


def configure_runner(
    model_config: ModelConfig,
    runner: str,
    pooler_config: dict[str, Any] | str | None,
    settings: RunnerSettings,
) -> RunnerSettings:
    """Fill `model_config`'s runner fields; returns the scheduler settings it allows."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {list(RUNNERS)}, got {runner!r}.")
    model_config.runner = resolve_runner(model_config.architecture, runner)
    check_architecture(model_config.architecture, model_config.runner)
    if model_config.runner != "pooling":
        if pooler_config is not None:
            raise ValueError("pooler_config applies only to runner='pooling'.")
        return settings
    model_class = model_class_for(model_config.architecture, model_config.runner)
    if model_config.format != "hf":
        raise ValueError("The pooling runner loads Hugging Face directories only, not GGUF files.")
    config = read_pooler_config(model_config.model, model_class.default_pooling_type)
    model_config.pooler_config = _override(config, pooler_config)
    model_config.pooling_tasks = tuple(model_class.pooling_tasks)
    model_config.is_encoder_only = bool(model_class.is_encoder_only)
    hf_config = model_config.hf_config
    model_config.is_matryoshka = bool(
        getattr(hf_config, "matryoshka_dimensions", None)
        or getattr(hf_config, "is_matryoshka", False)
    )
    if model_config.is_encoder_only:
        # Bidirectional attention: a prompt's every position sees the whole prompt, so it is
        # computed in one step and nothing of it can be reused from a cache.
        if settings.enable_chunked_prefill or settings.enable_prefix_caching:
            logger.info("Encoder-only model: chunked prefill and prefix caching are off.")
        return RunnerSettings(enable_chunked_prefill=False, enable_prefix_caching=False)
    return settings


def _override(config: PoolerConfig, override: dict[str, Any] | str | None) -> PoolerConfig:
    """vLLM's --pooler-config: a JSON object with `pooling_type` and / or `normalize`."""
    if override is None:
        return config
    if isinstance(override, str):
        try:
            override = json.loads(override)
        except json.JSONDecodeError as error:
            raise ValueError(f"pooler_config is not valid JSON: {error}") from None
    if not isinstance(override, dict) or set(override) - {"pooling_type", "normalize"}:
        raise ValueError(
            "pooler_config must be an object with 'pooling_type' and / or 'normalize', "
            f"got {override!r}."
        )
    pooling_type = str(override.get("pooling_type", config.pooling_type)).upper()
    check_pooling_type(pooling_type)
    normalize = override.get("normalize", config.normalize)
    if not isinstance(normalize, bool):
        raise ValueError(f"pooler_config.normalize must be true or false, got {normalize!r}.")  # noqa: TRY004
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize)
