"""The encoder cache, scheduler side: which images' encoder outputs the workers hold.

The workers keep each image's encoder output keyed by its content hash; this class decides
what they compute and what they may drop, counting space in encoder output tokens (the
`num_embeds` of an image). An output stays while a request still has placeholders of it
to compute (a reference); unreferenced, it stays cached until space is needed (least
recently released first), so a repeated image, a resumed (preempted) request or the next
chunk of a prompt finds it without running the encoder again.

`schedule_encoder_inputs` is the scheduler's hook: for a prompt chunk, which of its images
must be encoded this step, cutting the chunk before an image that cannot be (vLLM's
`_try_schedule_encoder_inputs`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tokenserve.core.request import Request


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        # hash → request ids that still need its output.
        self.cached: dict[str, set[str]] = {}
        # Unreferenced outputs still held, least recently released first: hash → tokens.
        self.freeable: OrderedDict[str, int] = OrderedDict()
        # Hashes evicted since the workers were last told.
        self.freed: list[str] = []

    def has_cache(self, identifier: str) -> bool:
        return identifier in self.cached

    def add_reference(self, request: Request, input_id: int) -> None:
        """The request will read the held output of its image `input_id`."""
        identifier = request.mm_features[input_id].identifier  # type: ignore[index]
        self.cached[identifier].add(request.request_id)
        self.freeable.pop(identifier, None)

    def can_allocate(self, num_embeds: int, reserved: int) -> bool:
        """Whether `num_embeds` more fit beside `reserved` already planned this step, evicting
        unreferenced outputs if needed. An image larger than the whole cache fits an empty one."""
        room = self.num_free_slots + sum(self.freeable.values()) - reserved
        if num_embeds <= room:
            return True
        return reserved == 0 and len(self.freeable) == len(self.cached)

    def allocate(self, request: Request, input_id: int) -> None:
        feature = request.mm_features[input_id]  # type: ignore[index]
        if feature.identifier in self.cached:  # the same image twice in one step
            self.cached[feature.identifier].add(request.request_id)
            self.freeable.pop(feature.identifier, None)
            return
        num_embeds = feature.num_embeds
        while self.num_free_slots < num_embeds and self.freeable:
            identifier, size = self.freeable.popitem(last=False)
            del self.cached[identifier]
            self.num_free_slots += size
            self.freed.append(identifier)
        self.cached.setdefault(feature.identifier, set()).add(request.request_id)
        self.num_free_slots -= num_embeds

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """The request needs the image's output no more (its placeholders are computed)."""
        feature = request.mm_features[input_id]  # type: ignore[index]
        users = self.cached.get(feature.identifier)
        if users is None or request.request_id not in users:
            return
        users.discard(request.request_id)
        if not users:
            self.freeable[feature.identifier] = feature.num_embeds

    def free(self, request: Request) -> None:
        """Drop every reference of a finished or preempted request."""
        for input_id in range(len(request.mm_features or ())):
            self.free_encoder_input(request, input_id)

    def get_freed_mm_hashes(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed


@dataclass
class EncoderPlan:
    """The encoder work of one step: images to run, by request, within the budget."""

    budget: int
    inputs: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class EncoderInputs:
    """A chunk's images: those to encode this step, and those whose held output it reads."""

    to_encode: list[int] = field(default_factory=list)
    reused: list[int] = field(default_factory=list)


def schedule_encoder_inputs(
    cache: EncoderCacheManager,
    plan: EncoderPlan,
    request: Request,
    num_computed_tokens: int,
    num_new_tokens: int,
) -> tuple[int, EncoderInputs]:
    """The chunk [num_computed_tokens, + num_new_tokens) of `request`: its length, cut before
    the first image whose encoder cannot run this step (encoder budget or cache space), and
    its images. Images already computed past need nothing; held ones are read. Nothing
    changes until the caller commits the images (`commit_encoder_inputs`) once the chunk is
    scheduled: a request that is not scheduled holds no reference."""
    inputs = EncoderInputs()
    identifiers: set[str] = set()
    budget, reserved = plan.budget, 0
    end = num_computed_tokens + num_new_tokens
    for input_id, feature in enumerate(request.mm_features or ()):
        if feature.offset >= end:
            break  # this image and the next ones lie after the chunk
        if feature.offset + feature.length <= num_computed_tokens:
            continue  # its placeholders are computed (or came from the prefix cache)
        if feature.identifier in identifiers:
            continue  # encoded for an earlier placeholder of this chunk
        if cache.has_cache(feature.identifier):
            inputs.reused.append(input_id)
            # A held output this chunk reads is no room for another image.
            reserved += cache.freeable.get(feature.identifier, 0)
            identifiers.add(feature.identifier)
            continue
        num_embeds = feature.num_embeds
        # An image bigger than the whole budget runs alone in a step rather than never.
        over_budget = num_embeds > budget and not (budget == plan.budget and not plan.inputs)
        if over_budget or not cache.can_allocate(num_embeds, reserved):
            num_new_tokens = max(0, feature.offset - num_computed_tokens)
            break
        budget -= num_embeds
        reserved += num_embeds
        identifiers.add(feature.identifier)
        inputs.to_encode.append(input_id)
    return num_new_tokens, inputs


def commit_encoder_inputs(
    cache: EncoderCacheManager, plan: EncoderPlan, request: Request, inputs: EncoderInputs
) -> None:
    # References first: allocating the new ones must not evict what the chunk reads.
    for input_id in inputs.reused:
        cache.add_reference(request, input_id)
    to_encode = inputs.to_encode
    for input_id in to_encode:
        cache.allocate(request, input_id)
        num_embeds = request.mm_features[input_id].num_embeds  # type: ignore[index]
        plan.budget -= num_embeds
    if to_encode:
        plan.inputs.setdefault(request.request_id, []).extend(to_encode)


def free_computed_encoder_inputs(cache: EncoderCacheManager, request: Request) -> None:
    """Release the images whose placeholders the request has now computed entirely."""
    for input_id, feature in enumerate(request.mm_features or ()):
        if feature.offset + feature.length <= request.num_computed_tokens:
            cache.free_encoder_input(request, input_id)
