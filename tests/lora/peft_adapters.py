"""PEFT LoRA adapters made at test time on the tiny models, and peft's greedy reference.

`init_lora_weights=False` draws B as well as A at random (peft's default B is zero, which
would make every adapter the base model). The fixtures (four adapters of the tiny llama)
are shared by tests/lora/ and the server tests (a plugin of tests/conftest.py); peft is
imported only when an adapter is made."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: str,
    directory: str | Path,
    seed: int,
    rank: int = 8,
    alpha: float = 16,
    use_rslora: bool = False,
    targets: list[str] | None = None,
) -> str:
    """Save a random LoRA adapter of `base_dir` with peft's save_pretrained; returns its path."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        init_lora_weights=False,
        use_rslora=use_rslora,
        lora_dropout=0.0,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = get_peft_model(base, config)
    model.save_pretrained(str(directory))
    return str(directory)


def peft_greedy(
    base_dir: str,
    adapters: dict[str, str],
    requests: list[tuple[list[int], str | None]],
    max_tokens: int,
) -> list[list[int]]:
    """Greedy tokens of each (prompt, adapter name or None) from peft, the adapter applied to
    the base model (not merged), or the base model alone."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    base.generation_config.eos_token_id = None
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()
    outputs = []
    for prompt, name in requests:
        kwargs = {
            "input_ids": torch.tensor([prompt]),
            "attention_mask": torch.ones(1, len(prompt), dtype=torch.long),
            "max_new_tokens": max_tokens,
            "do_sample": False,
            "pad_token_id": 0,
        }
        with torch.no_grad():
            if name is None:
                with model.disable_adapter():
                    generated = model.generate(**kwargs)
            else:
                model.set_adapter(name)
                generated = model.generate(**kwargs)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


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
