"""The model runner's own view of one running request.

Token ids live in a growable numpy buffer, so that batch inputs and the penalties'
output-token tensors are slices, not per-token Python work. Tensors that depend only on
the sampling params (the allowed-token mask, logit bias, the prompt's token mask) are
built once, the first step a request needs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenserve.lora.request import LoRARequest
from tokenserve.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    request_id: str
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None
    token_buffer: np.ndarray  # int64, capacity >= num_tokens
    num_tokens: int
    # The adapter its tokens run with (LoRA); None: the base model.
    lora_request: LoRARequest | None = None
    # Per-request tensors, built on first use (see the module docstring).
    cached_tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        request_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        sampling_params: SamplingParams,
        block_ids: list[int],
        num_computed_tokens: int,
        eos_token_id: int | None,
        lora_request: LoRARequest | None = None,
    ) -> CachedRequestState:
        capacity = len(token_ids) + min(sampling_params.max_tokens or 256, 256)
        buffer = np.empty(capacity, dtype=np.int64)
        buffer[: len(token_ids)] = token_ids
        return cls(
            request_id=request_id,
            num_prompt_tokens=num_prompt_tokens,
            sampling_params=sampling_params,
            block_ids=block_ids,
            num_computed_tokens=num_computed_tokens,
            eos_token_id=eos_token_id,
            token_buffer=buffer,
            num_tokens=len(token_ids),
            lora_request=lora_request,
        )

    @property
    def token_ids(self) -> np.ndarray:
        return self.token_buffer[: self.num_tokens]

    @property
    def prompt_token_ids(self) -> np.ndarray:
        return self.token_buffer[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> np.ndarray:
        return self.token_buffer[self.num_prompt_tokens : self.num_tokens]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        if self.num_tokens == len(self.token_buffer):
            grown = np.empty(2 * len(self.token_buffer), dtype=np.int64)
            grown[: self.num_tokens] = self.token_buffer[: self.num_tokens]
            self.token_buffer = grown
        self.token_buffer[self.num_tokens] = token_id
        self.num_tokens += 1
