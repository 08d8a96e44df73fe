"""Every adapter of a step at once: the per-token slot mapping and the shrink / expand.

Each wrapped layer keeps all `max_loras` slots' A matrices stacked in one
[slots · parts · max_rank, in] tensor and their B matrices in one
[out, slots · parts · max_rank] tensor, zero outside each part's own rows and each
adapter's rank (`layers.py`). A step then costs two products for all its adapters,
with no loop over requests or adapters (Punica's shrink and expand, as masked GEMMs):

    shrink:  h = x · A_allᵀ              [tokens, slots · parts · max_rank]
    select:  h *= mask                    a token keeps its slot's columns, times its scaling
    expand:  y += h · B_allᵀ              [tokens, out]

A base token (slot -1) has an all-zero mask row, so its output gains exact zeros; a step
without adapters skips both products. The extra work over a per-token gather is the
columns of the other slots, a few hundred at most against the thousands of the base
product, and dense GEMMs are what the CPU does fastest (docs/LORA.md, "Cost").
"""

from __future__ import annotations

import numpy as np
import torch

# Slot index of a token that runs on the base model alone.
NO_LORA = -1


class LoRABatchMapping:
    """One step's token → slot mapping, shared by every wrapped layer; masks are built once
    per step for each column layout (1, 2 or 3 parts per slot)."""

    def __init__(self, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        # Each slot's scaling (lora_alpha / r, or / √r with rsLoRA); 0 for an empty slot.
        self.slot_scaling = torch.zeros(max_loras, dtype=dtype)
        self.token_slots: torch.Tensor | None = None
        self._masks: dict[int, torch.Tensor] = {}

    @property
    def has_adapters(self) -> bool:
        return self.token_slots is not None

    def update(self, token_slots: np.ndarray | None) -> None:
        """This step's slot per token (NO_LORA for base tokens); None: no adapter at all."""
        self._masks.clear()
        if token_slots is None or not (token_slots != NO_LORA).any():
            self.token_slots = None
            return
        self.token_slots = torch.from_numpy(token_slots.astype(np.int64)).to(self.device)

    def mask(self, num_parts: int) -> torch.Tensor:
        """[tokens, slots · num_parts · max_rank]: the token's slot scaling on its slot's
        columns, 0 elsewhere."""
        mask = self._masks.get(num_parts)
        if mask is None:
            assert self.token_slots is not None
            width = num_parts * self.max_rank
            column_slot = torch.arange(self.max_loras, device=self.device).repeat_interleave(width)
            selected = self.token_slots[:, None] == column_slot[None, :]
            scaling = self.slot_scaling.to(self.device)[column_slot]
            mask = selected.to(self.dtype) * scaling[None, :]
            self._masks[num_parts] = mask
        return mask


def add_lora(
    output: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """output + ((x · lora_aᵀ) ⊙ mask) · lora_bᵀ: every token's own adapter, all at once."""
    shrunk = torch.mm(x.reshape(-1, x.shape[-1]), lora_a.t()).mul_(mask)
    return torch.addmm(output.reshape(-1, output.shape[-1]), shrunk, lora_b.t()).view_as(output)
