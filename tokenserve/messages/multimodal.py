"""Multimodal items as they cross from the API process to the engine core and its workers.

One `MultiModalFeature` per image of a prompt: the processor's tensors for it (pixels as
plain bytes, so msgpack carries them), its content hash (the encoder cache's key and a
block-hash extra key) and where its placeholder tokens sit in the prompt.
"""

from __future__ import annotations

import msgspec


class TensorData(msgspec.Struct, array_like=True):
    """A tensor as bytes: its dtype's name (torch's, e.g. "float32"), shape and raw buffer."""

    dtype: str
    shape: list[int]
    buffer: bytes


class MultiModalFeature(msgspec.Struct, array_like=True, omit_defaults=True):
    """One image of a prompt, processed.

    Its placeholder span is prompt positions [offset, offset + length); the positions of the
    span whose `embed_mask` entry is true take the encoder's outputs, in order (None: all
    of them). Tokens of the span outside the mask (Idefics3's row tags) stay text."""

    modality: str
    identifier: str  # the content hash (multimodal/hasher.py)
    offset: int
    length: int
    # The processor's outputs for this item (pixel_values, pixel_attention_mask, ...).
    data: dict[str, TensorData] = {}
    embed_mask: list[bool] | None = None

    @property
    def num_embeds(self) -> int:
        """Encoder outputs the item has: its cost against the encoder budget and cache."""
        return self.length if self.embed_mask is None else sum(self.embed_mask)
