"""A vision-language checkpoint's tensors, sorted: the language model's (renamed to the
names model/llama.py loads) and each vision module's (names relative to the module).

Checkpoints name the same tensors differently by the transformers version that saved them
(`language_model.model.layers...` or `model.language_model.layers...`): each part is
given its prefixes as (prefix, replacement) rules, the first that matches applies.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

Rules = tuple[tuple[str, str], ...]


@dataclass
class VLMWeights:
    language: list[tuple[str, object]] = field(default_factory=list)
    modules: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


def split_vlm_weights(
    weights: Iterable[tuple[str, object]], language: Rules, modules: dict[str, Rules]
) -> VLMWeights:
    parts = VLMWeights(modules={name: {} for name in modules})
    for name, tensor in weights:
        for prefix, replacement in language:
            if name.startswith(prefix):
                parts.language.append((replacement + name[len(prefix) :], tensor))
                break
        else:
            for module, rules in modules.items():
                match = next((prefix for prefix, _ in rules if name.startswith(prefix)), None)
                if match is not None:
                    parts.modules[module][name[len(match) :]] = tensor  # type: ignore[assignment]
                    break
            else:
                raise ValueError(f"Unexpected tensor {name!r} in the checkpoint.")
    return parts


def load_module_weights(
    module: nn.Module, tensors: dict[str, torch.Tensor], ignore: tuple[str, ...] = ()
) -> None:
    """Copy `tensors` into `module`'s parameters (cast to their dtype); every parameter must
    be given and every tensor used, but those starting with an `ignore` prefix."""
    tensors = {k: v for k, v in tensors.items() if not k.startswith(ignore)}
    result = module.load_state_dict(tensors, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"Unexpected tensor(s) in the checkpoint: {result.unexpected_keys[:5]}")
    if result.missing_keys:
        raise ValueError(f"The checkpoint is missing tensor(s): {result.missing_keys[:5]}")
