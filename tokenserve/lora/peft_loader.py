"""PEFT adapter directories: read, validated against the base model, loaded as A/B pairs.

A PEFT LoRA directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`,
`target_modules`, ...) and `adapter_model.safetensors` (or `.bin`) with one
`...layers.<i>.<self_attn|mlp>.<module>.lora_A.weight` [r, in] and `lora_B.weight`
[out, r] per adapted projection. The adapter adds `scaling · B · A · x` to the projection:
`scaling = lora_alpha / r`, or `lora_alpha / √r` with rsLoRA. Everything that does not fit
the base model or this engine is a ValueError naming the adapter and the reason: missing
files, a rank above `max_lora_rank`, modules other than q/k/v/o/gate/up/down, shapes that
differ from the base's projections, PEFT features that change the arithmetic (DoRA,
trained biases, per-module ranks).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenserve.lora.request import LoRARequest

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# The projections an adapter may target (HF names), by decoder-layer block.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass
class LoRAAdapter:
    """A loaded adapter: (layer index, module name) → (A [r, in], B [out, r])."""

    lora_request: LoRARequest
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


@dataclass(frozen=True)
class AdapterSpec:
    """What the adapter config says, once checked: its rank and scaling."""

    rank: int
    scaling: float
    weight_file: str


def base_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """Each targetable projection's [out, in] in the (unsharded) base model."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def read_adapter_spec(lora_request: LoRARequest, max_lora_rank: int) -> AdapterSpec:
    """The adapter's config, checked; its files must exist."""
    name, path = lora_request.lora_name, lora_request.lora_path
    if not os.path.isdir(path):
        raise ValueError(f"LoRA {name!r}: {path!r} is not a directory.")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA {name!r}: no {CONFIG_FILE} in {path!r}.")
    weight_file = next(
        (os.path.join(path, f) for f in WEIGHT_FILES if os.path.isfile(os.path.join(path, f))),
        None,
    )
    if weight_file is None:
        raise ValueError(f"LoRA {name!r}: no {' or '.join(WEIGHT_FILES)} in {path!r}.")
    try:
        with open(config_path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"LoRA {name!r}: cannot read {CONFIG_FILE}: {error}.") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA {name!r}: {CONFIG_FILE} is not a JSON object.")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA {name!r}: peft_type is {config.get('peft_type')!r}, not 'LORA'.")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA {name!r}: r must be a positive integer, got {rank!r}.")
    if rank > max_lora_rank:
        raise ValueError(
            f"LoRA {name!r}: rank {rank} is greater than max_lora_rank ({max_lora_rank})."
        )
    unsupported = [
        ("use_dora", config.get("use_dora")),
        ("rank_pattern", config.get("rank_pattern")),
        ("alpha_pattern", config.get("alpha_pattern")),
        ("modules_to_save", config.get("modules_to_save")),
        ("fan_in_fan_out", config.get("fan_in_fan_out")),
        ("lora_bias", config.get("lora_bias")),
    ]
    for key, value in unsupported:
        if value:
            raise ValueError(f"LoRA {name!r}: {key} is not supported.")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA {name!r}: bias={config.get('bias')!r} is not supported.")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA {name!r}: lora_alpha must be a number, got {alpha!r}.")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return AdapterSpec(rank, float(scaling), weight_file)


def _tensor_shapes(weight_file: str) -> dict[str, tuple[int, ...]]:
    if weight_file.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(weight_file, framework="pt") as file:
            return {key: tuple(file.get_slice(key).get_shape()) for key in file.keys()}  # noqa: SIM118
    return {key: tuple(value.shape) for key, value in _read_tensors(weight_file).items()}


def _read_tensors(weight_file: str) -> dict[str, torch.Tensor]:
    if weight_file.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(weight_file)
    import torch  # here: the API process checks adapters (check_adapter) without torch

    return torch.load(weight_file, map_location="cpu", weights_only=True)


def _check_tensors(
    lora_request: LoRARequest, spec: AdapterSpec, shapes: dict[str, tuple[int, ...]], hf_config
) -> dict[tuple[int, str], tuple[str, str]]:
    """(layer, module) → (A's name, B's name), every shape checked against the base."""
    name = lora_request.lora_name
    expected = base_shapes(hf_config)
    num_layers = hf_config.num_hidden_layers
    found: dict[tuple[int, str], dict[str, str]] = {}
    for tensor_name, shape in shapes.items():
        match = _TENSOR_NAME.search(tensor_name)
        if match is None:
            raise ValueError(
                f"LoRA {name!r}: tensor {tensor_name!r} is not a LoRA A/B weight of "
                f"{'/'.join(m[:-5] for m in TARGET_MODULES)} (embeddings, lm_head and "
                "modules_to_save are not supported)."
            )
        layer, module, kind = int(match.group(1)), match.group(2), match.group(3)
        if module not in expected:
            raise ValueError(
                f"LoRA {name!r}: target module {module!r} is not supported; "
                f"supported: {', '.join(TARGET_MODULES)}."
            )
        if layer >= num_layers:
            raise ValueError(
                f"LoRA {name!r}: tensor {tensor_name!r} is for layer {layer}, but the base "
                f"model has {num_layers} layers."
            )
        out_size, in_size = expected[module]
        want = (spec.rank, in_size) if kind == "A" else (out_size, spec.rank)
        if shape != want:
            raise ValueError(
                f"LoRA {name!r}: {tensor_name} has shape {list(shape)}, but the base model's "
                f"{module} needs {list(want)} (rank {spec.rank}); was the adapter trained on "
                "another model?"
            )
        found.setdefault((layer, module), {})[kind] = tensor_name
    if not found:
        raise ValueError(f"LoRA {name!r}: its weights hold no LoRA tensors.")
    for (layer, module), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA {name!r}: layer {layer} {module} lacks its lora_A or lora_B.")
    return {key: (pair["A"], pair["B"]) for key, pair in found.items()}


def check_adapter(lora_request: LoRARequest, hf_config, max_lora_rank: int) -> AdapterSpec:
    """Validate an adapter without loading its weights (shapes from the file's header)."""
    spec = read_adapter_spec(lora_request, max_lora_rank)
    try:
        shapes = _tensor_shapes(spec.weight_file)
    except (OSError, RuntimeError, ValueError) as error:
        raise ValueError(f"LoRA {lora_request.lora_name!r}: cannot read its weights: {error}.") from None
    _check_tensors(lora_request, spec, shapes, hf_config)
    return spec


def load_adapter(
    lora_request: LoRARequest, hf_config, max_lora_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """Read, validate and load an adapter's A/B pairs in `dtype`, on the CPU."""
    spec = read_adapter_spec(lora_request, max_lora_rank)
    try:
        tensors = _read_tensors(spec.weight_file)
    except (OSError, RuntimeError, ValueError) as error:
        raise ValueError(f"LoRA {lora_request.lora_name!r}: cannot read its weights: {error}.") from None
    names = _check_tensors(
        lora_request, spec, {key: tuple(value.shape) for key, value in tensors.items()}, hf_config
    )
    weights = {
        key: (tensors[a].to(dtype).contiguous(), tensors[b].to(dtype).contiguous())
        for key, (a, b) in names.items()
    }
    return LoRAAdapter(lora_request, spec.rank, spec.scaling, weights)
