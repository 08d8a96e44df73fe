"""What the scheduler decided for one step, as the model runner needs it.

The runner keeps its own per-request state, so a request's tokens and block table
travel in full only when it is (re)admitted; afterwards only the diffs do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenserve.lora.request import LoRARequest
from tokenserve.messages.multimodal import MultiModalFeature
from tokenserve.pooling_params import PoolingParams
from tokenserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request admitted this step: fresh, or resumed after preemption."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    pooling_params: PoolingParams | None = None
    # Its adapter (the runner maps its tokens to the adapter's slot); None: the base model.
    lora_request: LoRARequest | None = None
    # Its images (placeholders, pixels, hashes); None: text only.
    mm_features: list[MultiModalFeature] | None = None


@dataclass
class CachedRequestData:
    """A request that kept running: the blocks it gained this step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Under pipeline parallelism, the sampled tokens among this step's positions (they end
    # at its last one): the stages before the last never sampled them. Empty otherwise.
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # Tokens each scheduled request computes this step, in batch order: a decode row's last
    # token and its drafts, or a prompt chunk.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Draft tokens each decode row verifies this step (speculative decoding): the last of its
    # scheduled tokens; the step samples every one of its last len(drafts) + 1 positions.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests the runner should forget: finished, aborted or preempted since the last step.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Images whose encoder runs this step: request id → indices into its mm_features.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    # Encoder outputs the workers may drop (evicted from the encoder cache), by image hash.
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # With a KV connector: the step's loads and saves (a kv_transfer KVConnectorMetadata).
    kv_connector_metadata: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
