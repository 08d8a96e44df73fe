"""LoRA fixtures: four peft adapters of the tiny llama (different ranks, alphas, rsLoRA,
targets), made once per session, and prompts."""

from __future__ import annotations

import random

import pytest

from tests.lora.peft_adapters import make_adapter

# name → (seed, rank, alpha, rsLoRA, targets); "a3" adapts the attention only.
ADAPTERS = {
    "a0": (10, 8, 16, False, None),
    "a1": (11, 4, 8, False, None),
    "a2": (12, 16, 8, True, None),
    "a3": (13, 8, 32, False, ["q_proj", "v_proj", "o_proj"]),
}


@pytest.fixture(scope="session")
def lora_base(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def lora_adapters(lora_base, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_adapters")
    return {
        name: make_adapter(lora_base, root / name, seed, rank, alpha, rslora, targets)
        for name, (seed, rank, alpha, rslora, targets) in ADAPTERS.items()
    }


@pytest.fixture(scope="session")
def lora_prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 400) for _ in range(n)] for n in (6, 21, 45)]
