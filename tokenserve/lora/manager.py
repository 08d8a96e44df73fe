"""The worker's adapters: loaded copies, slots, and each step's token → slot mapping.

Adapters are loaded from their PEFT directories on first use and kept, at most
`max_cpu_loras` of them, the least recently used dropped first. A step's adapters each
take one of the `max_loras` slots of the wrapped layers: an adapter already in a slot
stays there; a new one takes a free slot or the least recently used one that this step
does not need (the scheduler never puts more than `max_loras` adapters in one step).
Then `set_active_loras` sets the step's per-token slots for every wrapped layer at once.

The fused decode layer (model/fused_decode.py, one C call per decoder layer) knows no
adapters: a step with any adapter token runs operator by operator, a base-only step
keeps it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from tokenserve.config import LoRAConfig
from tokenserve.lora.layers import LoRALinear, wrap_linear_layers
from tokenserve.lora.peft_loader import TARGET_MODULES, LoRAAdapter, load_adapter
from tokenserve.lora.punica import NO_LORA, LoRABatchMapping
from tokenserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAModelManager:
    def __init__(
        self,
        model: nn.Module,
        lora_config: LoRAConfig,
        hf_config,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = lora_config
        self.hf_config = hf_config
        self.dtype = dtype
        self.mapping = LoRABatchMapping(
            lora_config.max_loras, lora_config.max_lora_rank, dtype, device
        )
        self.layers: list[tuple[int, LoRALinear]] = wrap_linear_layers(
            model, self.mapping, TARGET_MODULES
        )
        # The fused decode path runs base-only steps; its own switch is kept.
        self.layer_stack = getattr(model.model, "layer_stack", None)
        self.fused_enabled = bool(getattr(self.layer_stack, "enabled", False))
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()
        # Adapter id → slot, least recently used first, and the adapter each slot holds.
        self.slot_of: OrderedDict[int, int] = OrderedDict()
        self.slotted: dict[int, LoRARequest] = {}
        logger.info(
            "LoRA: %d linear layers wrapped, %d slots of rank %d, up to %d adapters loaded.",
            len(self.layers), lora_config.max_loras, lora_config.max_lora_rank,
            lora_config.max_cpu_loras,
        )

    # ---- adapters in memory ---------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest, keep: Sequence[int] = ()) -> LoRAAdapter:
        """The adapter, loaded now unless it already is; beyond max_cpu_loras the least
        recently used one not in `keep` is dropped (its slot, if any, stays valid)."""
        adapter = self.loaded.get(lora_request.lora_int_id)
        if adapter is not None and adapter.lora_request == lora_request:
            self.loaded.move_to_end(lora_request.lora_int_id)
            return adapter
        if adapter is not None:
            # The same id for another adapter: the old copy and its slot are stale.
            self.remove_lora(lora_request.lora_int_id)
        adapter = load_adapter(
            lora_request, self.hf_config, self.config.max_lora_rank, self.dtype
        )
        while len(self.loaded) >= self.config.max_cpu_loras:
            victim = next((i for i in self.loaded if i not in keep), None)
            if victim is None:
                break
            del self.loaded[victim]
        self.loaded[lora_request.lora_int_id] = adapter
        return adapter

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: its loaded copy and its slot."""
        slot = self.slot_of.pop(lora_int_id, None)
        self.slotted.pop(lora_int_id, None)
        if slot is not None:
            self._clear_slot(slot)
        return self.loaded.pop(lora_int_id, None) is not None or slot is not None

    def list_loras(self) -> list[int]:
        return list(self.loaded)

    # ---- one step -------------------------------------------------------------------

    def set_active_loras(
        self, lora_requests: Sequence[LoRARequest | None], num_tokens: Sequence[int]
    ) -> None:
        """Slot every adapter of the step and map each request's tokens (contiguous, in
        batch order) to its adapter's slot."""
        wanted: dict[int, LoRARequest] = {}
        for lora_request in lora_requests:
            if lora_request is not None:
                wanted.setdefault(lora_request.lora_int_id, lora_request)
        if not wanted:
            self.mapping.update(None)
            self._allow_fused(True)
            return
        if len(wanted) > self.config.max_loras:
            raise ValueError(
                f"A step holds {len(wanted)} adapters, more than max_loras "
                f"({self.config.max_loras})."
            )
        slots = {i: self._activate(request, wanted) for i, request in wanted.items()}
        request_slots = np.array(
            [NO_LORA if r is None else slots[r.lora_int_id] for r in lora_requests],
            dtype=np.int64,
        )
        self.mapping.update(np.repeat(request_slots, np.asarray(num_tokens, dtype=np.int64)))
        self._allow_fused(not self.mapping.has_adapters)

    def _activate(self, lora_request: LoRARequest, wanted: dict[int, LoRARequest]) -> int:
        """The adapter's slot, filling one (free, or the least recently used unwanted one)."""
        lora_int_id = lora_request.lora_int_id
        if lora_int_id in self.slot_of and self.slotted[lora_int_id] == lora_request:
            self.slot_of.move_to_end(lora_int_id)
            if lora_int_id in self.loaded:
                self.loaded.move_to_end(lora_int_id)
            return self.slot_of[lora_int_id]
        adapter = self.add_lora(lora_request, keep=list(wanted))
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is None:
            used = set(self.slot_of.values())
            free = [s for s in range(self.config.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self.slot_of if i not in wanted)
                slot = self.slot_of.pop(victim)
                del self.slotted[victim]
        for layer_index, layer in self.layers:
            layer.set_slot(slot, adapter, layer_index)
        self.mapping.slot_scaling[slot] = adapter.scaling
        self.slot_of[lora_int_id] = slot
        self.slotted[lora_int_id] = lora_request
        return slot

    def _clear_slot(self, slot: int) -> None:
        for _, layer in self.layers:
            layer.clear_slot(slot)
        self.mapping.slot_scaling[slot] = 0.0

    def _allow_fused(self, allowed: bool) -> None:
        if self.layer_stack is not None and hasattr(self.layer_stack, "enabled"):
            self.layer_stack.enabled = self.fused_enabled and allowed
