"""Every adapter of a step at once: the per-token slot mapping and the shrink / expand.

Each wrapped layer keeps all `max_loras` slots' A matrices stacked in one
[parts · slots · max_rank, in] tensor and their B matrices in one [out, slots · max_rank]
tensor (a part's output rows hold its own B's), zero beyond each adapter's rank
(`layers.py`). A step then costs one shrink and one expand per part for all its adapters,
with no loop over requests or adapters (Punica's shrink and expand, as masked GEMMs):

    shrink:  h = x · A_allᵀ                  [tokens, parts · slots · max_rank]
    select:  h_p = h[part p] ⊙ mask           a token keeps its slot's columns, times its scaling
    expand:  y[rows of p] += h_p · B[rows of p]ᵀ

A base token (slot -1) has an all-zero mask row, so its output gains exact zeros; a step
without adapters skips both products. The extra work over a per-token gather is the
columns of the other slots (slots · max_rank against the hundreds to thousands of the base
product), and dense GEMMs are what the CPU does fastest (docs/LORA.md, "Cost").
"""

from __future__ import annotations

import numpy as np
import torch

# Slot index of a token that runs on the base model alone.
NO_LORA = -1


class LoRABatchMapping:
    """One step's token → slot mapping, shared by every wrapped layer; its mask is built
    once per step."""

    def __init__(self, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        # Each slot's scaling (lora_alpha / r, or / √r with rsLoRA); 0 for an empty slot.
        self.slot_scaling = torch.zeros(max_loras, dtype=dtype)
        self.token_slots: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    @property
    def has_adapters(self) -> bool:
        return self.token_slots is not None

    def update(self, token_slots: np.ndarray | None) -> None:
        """This step's slot per token (NO_LORA for base tokens); None: no adapter at all."""
        self._mask = None
        if token_slots is None or not (token_slots != NO_LORA).any():
            self.token_slots = None
            return
        self.token_slots = torch.from_numpy(token_slots.astype(np.int64)).to(self.device)

    @property
    def mask(self) -> torch.Tensor:
        """[tokens, slots · max_rank]: the token's slot scaling on its slot's columns, 0
        elsewhere."""
        if self._mask is None:
            assert self.token_slots is not None
            column_slot = torch.arange(self.max_loras, device=self.device).repeat_interleave(
                self.max_rank
            )
            selected = self.token_slots[:, None] == column_slot[None, :]
            scaling = self.slot_scaling.to(self.device)[column_slot]
            self._mask = selected.to(self.dtype) * scaling[None, :]
        return self._mask


def add_lora(
    output: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    part_sizes: list[int],
    mask: torch.Tensor,
) -> torch.Tensor:
    """output (+=, in place) each token's own adapter for every part at once:
    output[rows of p] += ((x · A_pᵀ) ⊙ mask) · B_pᵀ."""
    out = output.reshape(-1, output.shape[-1])
    shrunk = torch.mm(x.reshape(-1, x.shape[-1]), lora_a.t())
    width = mask.shape[1]
    first_row = 0
    for part, rows in enumerate(part_sizes):
        selected = shrunk[:, part * width : (part + 1) * width] * mask
        out[:, first_row : first_row + rows].addmm_(
            selected, lora_b[first_row : first_row + rows].t()
        )
        first_row += rows
    return output
