"""How a pooling model's output becomes a request's result.

`read_pooler_config`: the pooling of a sentence-transformers directory (`modules.json`, its
Pooling module's `config.json`: cls / mean / lasttoken; a Normalize module), else the
architecture's default (decoders: last token, BERT: CLS; embeddings normalized), as vLLM.
`pool_rows` and `apply_task_head`: the pooled vector of one request from its hidden states,
then its task's head (embed: matryoshka `dimensions`, L2 normalization; classify / score:
softmax, or sigmoid for a single label).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from tokenserve.config import POOLING_TYPES, PoolerConfig
from tokenserve.pooling_params import PoolingParams

if TYPE_CHECKING:
    import torch

_ST_MODULES_FILE = "modules.json"
_ST_POOLING_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_ST_MODE_NAMES = {"cls": "cls_token", "mean": "mean_tokens", "lasttoken": "lasttoken"}
_ST_SUPPORTED_MODULES = ("Transformer", "Pooling", "Normalize")


def read_pooler_config(model_dir: str | None, default_pooling_type: str) -> PoolerConfig:
    """The pooling a sentence-transformers directory declares, else the model's default."""
    modules_path = os.path.join(model_dir, _ST_MODULES_FILE) if model_dir else None
    if modules_path is None or not os.path.isfile(modules_path):
        return PoolerConfig(pooling_type=default_pooling_type, normalize=True)
    try:
        with open(modules_path, encoding="utf-8") as file:
            modules = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"Cannot read {modules_path}: {error}") from error
    config = PoolerConfig(pooling_type=default_pooling_type, normalize=False)
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _ST_SUPPORTED_MODULES:
            raise ValueError(
                f"{modules_path}: sentence-transformers module {module.get('type')!r} is not "
                f"supported (supported: {', '.join(_ST_SUPPORTED_MODULES)})."
            )
        if kind == "Normalize":
            config.normalize = True
        elif kind == "Pooling":
            config.pooling_type = _read_st_pooling(os.path.join(model_dir, module.get("path", "")))
    return config


def _read_st_pooling(module_dir: str) -> str:
    path = os.path.join(module_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as file:
            settings = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"Cannot read the Pooling module's {path}: {error}") from error
    # Newer sentence-transformers write `"pooling_mode": "mean"`, older ones one flag per mode.
    named = settings.get("pooling_mode")
    if isinstance(named, str):
        chosen = [f"pooling_mode_{_ST_MODE_NAMES.get(named, named)}"]
    else:
        chosen = [k for k, v in settings.items() if k.startswith("pooling_mode_") and v is True]
    if len(chosen) != 1 or chosen[0] not in _ST_POOLING_MODES:
        raise ValueError(
            f"{path}: one of cls, mean or lasttoken pooling is supported, got {chosen or named}."
        )
    return _ST_POOLING_MODES[chosen[0]]


def check_pooling_type(pooling_type: str) -> str:
    if pooling_type not in POOLING_TYPES:
        raise ValueError(
            f"pooling_type must be one of {list(POOLING_TYPES)}, got {pooling_type!r}."
        )
    return pooling_type


def apply_task_head(
    output: torch.Tensor, params: PoolingParams, task: str, normalize_default: bool
) -> torch.Tensor:
    """One request's result from the model's pooled output ([hidden] or [num_labels])."""
    import torch  # engine side only: the configuration's readers above come without it
    import torch.nn.functional as F

    output = output.float()
    if task == "embed":
        if params.dimensions is not None:
            output = output[: params.dimensions]
        normalize = normalize_default if params.normalize is None else params.normalize
        return F.normalize(output, p=2, dim=-1) if normalize else output
    if params.use_activation is False:
        return output
    # One label: a relevance probability; several: a distribution over them.
    return torch.sigmoid(output) if output.numel() == 1 else output.softmax(dim=-1)
