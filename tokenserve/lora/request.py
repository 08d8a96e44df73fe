"""`LoRARequest`: which adapter a request runs with (vLLM's fields and meaning).

A leaf: it imports nothing of tokenserve, so the wire messages (messages/) can carry it.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """An adapter: a name, an integer id unique among the engine's adapters (> 0), and its
    PEFT directory (`adapter_config.json` + `adapter_model.safetensors`).

    The id is what the workers key their loaded copies and slots by; the name and the id
    together key the KV blocks the adapter computes (`block_hash_key`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    # The model the adapter was trained on (shown as its parent in /v1/models).
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string.")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an integer, got {self.lora_int_id!r}.")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be at least 1, got {self.lora_int_id}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRA {self.lora_name!r}: lora_path must be a directory.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def block_hash_key(self) -> str:
        """The block-hash extra key of this adapter's KV: its blocks are its own."""
        return f"lora:{self.lora_int_id}:{self.lora_name}"
