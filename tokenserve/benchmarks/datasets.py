"""Benchmark prompts as WORKLOADS.md defines them: random token ids from a fixed seed, and
W6's input-grounded chats (repeat or lightly edit a passage, `grounded_edit_conversations`).

`random_token_prompts` feeds the offline benchmark; `BenchRequest` lists (with their send
times) feed the serving benchmark: `random`, `shared-prefix` and `mixed` (long requests at
t=0 among short ones arriving at a Poisson rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# WORKLOADS.md draws ids from [100, vocab_size - 100): clear of the special tokens at both ends.
TOKEN_ID_MARGIN = 100


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    send_time: float = 0.0  # seconds after the benchmark starts
    group: str = "all"  # "short" or "long" in the mixed dataset


def random_token_prompts(
    num_prompts: int,
    input_len: int,
    vocab_size: int,
    seed: int = 0,
    prefix_len: int = 0,
) -> list[list[int]]:
    """Token ids drawn uniformly from [100, vocab_size - 100); an optional shared prefix."""
    if vocab_size <= 2 * TOKEN_ID_MARGIN:
        raise ValueError(f"vocab_size must exceed {2 * TOKEN_ID_MARGIN}, got {vocab_size}.")
    rng = np.random.default_rng(seed)
    low, high = TOKEN_ID_MARGIN, vocab_size - TOKEN_ID_MARGIN
    prefix = rng.integers(low, high, size=prefix_len).tolist()
    return [prefix + rng.integers(low, high, size=input_len).tolist() for _ in range(num_prompts)]


def poisson_send_times(count: int, rate: float, seed: int) -> list[float]:
    """Send times of a Poisson process at `rate` requests/s, the first at 0; all 0 if rate is inf."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive (or inf), got {rate}.")
    if math.isinf(rate) or count == 0:
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def uniform_requests(
    prompts: list[list[int]], output_len: int, send_times: list[float], group: str = "all"
) -> list[BenchRequest]:
    return [
        BenchRequest(prompt, output_len, send_time, group)
        for prompt, send_time in zip(prompts, send_times, strict=True)
    ]


def mixed_requests(
    num_long: int,
    long_input_len: int,
    long_output_len: int,
    num_short: int,
    short_input_len: int,
    short_output_len: int,
    short_rate: float,
    vocab_size: int,
    dataset_seed: int,
    arrival_seed: int,
) -> list[BenchRequest]:
    """W4: `num_long` long requests sent at t=0, and short ones arriving at `short_rate`."""
    # Distinct seeds keep the long and the short prompts from sharing a prefix.
    long_prompts = random_token_prompts(num_long, long_input_len, vocab_size, dataset_seed)
    short_prompts = random_token_prompts(num_short, short_input_len, vocab_size, dataset_seed + 1)
    return uniform_requests(long_prompts, long_output_len, [0.0] * num_long, "long") + (
        uniform_requests(
            short_prompts,
            short_output_len,
            poisson_send_times(num_short, short_rate, arrival_seed),
            "short",
        )
    )


# W6: passages of sentences drawn from these parts by a seeded generator (about 300 tokens
# with SmolLM2's tokenizer), and the instructions that ask to repeat or lightly edit them.
_SUBJECTS = ("The old keeper", "A young engineer", "The village council", "Our neighbour",
             "The river pilot", "A travelling merchant", "The head librarian", "The night nurse")
_VERBS = ("carefully inspected", "quietly repaired", "proudly described", "slowly painted",
          "briefly visited", "patiently measured", "eagerly photographed", "often cleaned")
_OBJECTS = ("the wooden bridge over the river", "the lamp at the top of the lighthouse",
            "the stone wall behind the market", "the clock in the town hall tower",
            "the narrow road to the northern farms", "the boats resting in the harbour",
            "the garden beside the railway station", "the maps kept in the archive")
_ENDINGS = ("before the first light of morning.", "while the rain kept falling outside.",
            "as the bells rang for the evening.", "after the long and busy market day.",
            "during the coldest week of the winter.", "because nobody else had the time.")
_INSTRUCTIONS = (
    "Repeat the following passage exactly, word for word.",
    (
        "Copy the following passage, but replace the word \"the\" with \"this\" where it "
        "starts a sentence."
    ),
    "Rewrite the following passage exactly, with each sentence on its own line.",
    "Repeat the following passage, correcting nothing and adding nothing.",
)
GROUNDED_PASSAGE_SENTENCES = 16


def grounded_passage(rng: np.random.Generator, num_sentences: int) -> str:
    parts = (_SUBJECTS, _VERBS, _OBJECTS, _ENDINGS)
    return " ".join(
        " ".join(choices[int(rng.integers(len(choices)))] for choices in parts)
        for _ in range(num_sentences)
    )


def grounded_edit_conversations(num_prompts: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """W6: one user turn each, an instruction to repeat or lightly edit a passage and the
    passage, from a fixed seed (outputs that copy their input: speculative decoding's case)."""
    rng = np.random.default_rng(seed)
    conversations = []
    for index in range(num_prompts):
        passage = grounded_passage(rng, GROUNDED_PASSAGE_SENTENCES)
        instruction = _INSTRUCTIONS[index % len(_INSTRUCTIONS)]
        conversations.append([{"role": "user", "content": f"{instruction}\n\n{passage}"}])
    return conversations
