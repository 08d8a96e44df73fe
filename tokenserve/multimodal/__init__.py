"""Images into a prompt: content hashes, transformers' processors, placeholder expansion.

- `hasher.py`: an image's content hash (pixels, mode, size): the encoder cache's key and a
  block-hash extra key.
- `processing.py`: `MultiModalProcessor`, a prompt's `multi_modal_data` through the model's
  Hugging Face processor (AutoProcessor) → expanded prompt token ids and one
  `MultiModalFeature` (messages/multimodal.py) per image.
- `tensors.py`: tensors to and from the bytes that cross to the engine core.
- `media.py`, `media_security.py` (API process): fetching image URLs (data:, http(s),
  file:) with every hop checked (docs/MEDIA_SECURITY.md).
"""
