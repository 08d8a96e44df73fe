"""A prompt's images through the model's Hugging Face processor.

`MultiModalProcessor.process` takes the prompt's token ids, in which each image stands as
one image token (`<image>`), and its images. Each image goes through transformers'
processor alone (AutoProcessor: resizing, splitting, normalising are transformers' own),
which gives its pixels and the tokens its placeholder expands to (LLaVA: N image tokens;
Idefics3: rows of tiles with their tags); the expansions are spliced in, so the prompt's
ids are those transformers' processor gives the whole prompt (as vLLM returns them).
Each image becomes a `MultiModalFeature`: its hash, pixels and placeholder span.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import transformers
from PIL import Image

from tokenserve.config import MultiModalConfig
from tokenserve.messages.multimodal import MultiModalFeature
from tokenserve.multimodal.hasher import hash_image
from tokenserve.multimodal.tensors import to_tensor_data

logger = logging.getLogger(__name__)

# Processed images kept by hash (a repeated image is not processed again).
_PROCESSED_CACHE_SIZE = 64
# Processor outputs that describe the text, not the image.
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids")


class MultiModalProcessor:
    def __init__(self, model_dir: str, tokenizer, config: MultiModalConfig) -> None:
        try:
            self.hf_processor = transformers.AutoProcessor.from_pretrained(
                model_dir, local_files_only=True
            )
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"Cannot load the image processor of {model_dir!r}: {error}") from error
        self.config = config
        # Chats are rendered with the tokenizer: a template kept only by the processor
        # (chat_template.json / processor config) must reach it.
        template = getattr(self.hf_processor, "chat_template", None)
        if template and not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = template
        self.image_token = str(self.hf_processor.image_token)
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        # hash → (the placeholder's expansion, the processor's tensors as TensorData).
        self._processed: OrderedDict[str, tuple[list[int], dict[str, Any]]] = OrderedDict()

    def process(
        self, token_ids: list[int], mm_data: Mapping[str, Any]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt's ids with each image token expanded, and one feature per image."""
        images = self._images(mm_data)
        positions = [i for i, token_id in enumerate(token_ids) if token_id == self.image_token_id]
        if len(positions) != len(images):
            raise ValueError(
                f"The prompt has {len(positions)} image placeholder(s) ({self.image_token!r}) "
                f"but {len(images)} image(s) were given: put one {self.image_token!r} where "
                "each image goes."
            )
        expanded: list[int] = []
        features: list[MultiModalFeature] = []
        previous = 0
        for index, (position, image) in enumerate(zip(positions, images)):
            identifier = hash_image(image)
            expansion, data = self._process_image(index, image, identifier)
            expanded.extend(token_ids[previous:position])
            embed_at = [i for i, t in enumerate(expansion) if t == self.image_token_id]
            first, last = embed_at[0], embed_at[-1]
            mask = [t == self.image_token_id for t in expansion[first : last + 1]]
            features.append(
                MultiModalFeature(
                    modality="image",
                    identifier=identifier,
                    offset=len(expanded) + first,
                    length=last - first + 1,
                    data=data,
                    embed_mask=None if all(mask) else mask,
                )
            )
            expanded.extend(expansion)
            previous = position + 1
        expanded.extend(token_ids[previous:])
        return expanded, features

    def _images(self, mm_data: Mapping[str, Any]) -> list[Image.Image]:
        if not isinstance(mm_data, Mapping):
            raise ValueError("multi_modal_data must be a dict such as {'image': image}.")
        unknown = set(mm_data) - {"image"}
        if unknown:
            raise ValueError(
                f"multi_modal_data has unsupported modality {sorted(unknown)}; supported: 'image'."
            )
        images = mm_data.get("image")
        if images is None:
            return []
        if not isinstance(images, Sequence) or isinstance(images, (str, bytes)):
            images = [images]
        images = list(images)
        for index, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise ValueError(
                    f"multi_modal_data['image'][{index}] must be a PIL image, got "
                    f"{type(image).__name__}."
                )
        limit = self.config.get_limit_per_prompt("image")
        if len(images) > limit:
            raise ValueError(
                f"The prompt has {len(images)} images, more than limit_mm_per_prompt allows "
                f"({{'image': {limit}}})."
            )
        return images

    def _process_image(
        self, index: int, image: Image.Image, identifier: str
    ) -> tuple[list[int], dict[str, Any]]:
        cached = self._processed.get(identifier)
        if cached is not None:
            self._processed.move_to_end(identifier)
            return cached
        try:
            outputs = self.hf_processor(
                text=self.image_token, images=[image], add_special_tokens=False,
                return_tensors="pt",
            )
        except Exception as error:  # any failure on a bad image is the input's fault
            raise ValueError(f"Cannot process image {index}: {error}") from error
        expansion = [int(t) for t in outputs["input_ids"][0]]
        if self.image_token_id not in expansion:
            raise ValueError(f"Image {index} gave no image tokens after processing.")
        data = {
            key: to_tensor_data(value)
            for key, value in outputs.items()
            if key not in _TEXT_KEYS and hasattr(value, "shape")
        }
        self._processed[identifier] = (expansion, data)
        if len(self._processed) > _PROCESSED_CACHE_SIZE:
            self._processed.popitem(last=False)
        return expansion, data
