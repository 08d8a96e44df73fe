"""The encoder cache, worker side: image encoder outputs by image hash, and the step's
input embeddings with each image's rows in place of its placeholder tokens'.

The scheduler (core/encoder_cache_manager.py) decides which images run in a step
(`scheduled_encoder_inputs`) and which outputs may be dropped (`free_encoder_mm_hashes`);
this class only follows. An image's output is computed whole (the encoder sees the whole
image) and read by as many prompt chunks, requests and resumptions as the scheduler lets
use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenserve.messages.multimodal import MultiModalFeature
from tokenserve.messages.scheduler_output import SchedulerOutput
from tokenserve.multimodal.tensors import from_tensor_data


@dataclass
class ChunkRows:
    """A request's chunk in the flat batch: prompt positions [start, end) at flat_start."""

    request_id: str
    flat_start: int
    start: int
    end: int


class EncoderRunner:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cache: dict[str, torch.Tensor] = {}
        # Each unfinished request's images (kept through preemption: the scheduler may have
        # planned an image of a request preempted later in the same step).
        self.features: dict[str, list[MultiModalFeature]] = {}
        # Encoder runs since the engine started (one per image encoded).
        self.num_encoder_runs = 0

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_req_ids:
            self.features.pop(request_id, None)
        for identifier in scheduler_output.free_encoder_mm_hashes:
            self.cache.pop(identifier, None)
        for new in scheduler_output.scheduled_new_reqs:
            if new.mm_features:
                self.features[new.request_id] = new.mm_features

    def execute_encoders(self, model: torch.nn.Module, scheduler_output: SchedulerOutput) -> None:
        for request_id, input_ids in scheduler_output.scheduled_encoder_inputs.items():
            for input_id in input_ids:
                feature = self.features[request_id][input_id]
                if feature.identifier in self.cache:
                    continue
                data = {
                    name: from_tensor_data(value).to(self.device)
                    for name, value in feature.data.items()
                }
                output = model.embed_multimodal(data)
                if output.shape[0] != feature.num_embeds:
                    raise RuntimeError(
                        f"The encoder gave {output.shape[0]} rows for an image with "
                        f"{feature.num_embeds} image tokens."
                    )
                self.cache[feature.identifier] = output
                self.num_encoder_runs += 1

    def inputs_embeds(
        self, model: torch.nn.Module, input_ids: torch.Tensor, chunks: list[ChunkRows]
    ) -> torch.Tensor | None:
        """The step's input embeddings with the images' rows in place, or None when no
        chunk of the step covers an image token."""
        flat_indices: list[np.ndarray] = []
        rows: list[torch.Tensor] = []
        for chunk in chunks:
            for feature in self.features.get(chunk.request_id, ()):
                lo = max(chunk.start, feature.offset)
                hi = min(chunk.end, feature.offset + feature.length)
                if lo >= hi:
                    continue
                mask = np.ones(feature.length, dtype=bool)
                if feature.embed_mask is not None:
                    mask = np.asarray(feature.embed_mask, dtype=bool)
                # Row k of the output goes to the span's k-th embedded position.
                row_of = np.cumsum(mask) - 1
                local = np.arange(lo - feature.offset, hi - feature.offset)
                local = local[mask[local]]
                if local.size == 0:
                    continue
                output = self.cache[feature.identifier]
                rows.append(output[torch.from_numpy(row_of[local])])
                flat_indices.append(chunk.flat_start + (local + feature.offset - chunk.start))
        if not rows:
            return None
        embeds = model.embed_input_ids(input_ids).clone()
        index = torch.from_numpy(np.concatenate(flat_indices)).to(self.device)
        embeds[index] = torch.cat(rows).to(embeds.dtype)
        return embeds
