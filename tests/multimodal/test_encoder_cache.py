"""The pieces under the engine: image hashes in block hashes, the scheduler's encoder cache
(references, eviction of unreferenced outputs only, the chunk cut before an image that
cannot be encoded), and image features across the msgpack wire."""

from __future__ import annotations

import torch

from tests.multimodal.conftest import random_image
from tokenserve.core.block_hash import extend_block_hashes, get_hash_function
from tokenserve.core.encoder_cache_manager import (
    EncoderCacheManager,
    EncoderPlan,
    commit_encoder_inputs,
    schedule_encoder_inputs,
)
from tokenserve.core.request import Request
from tokenserve.messages.engine_core import (
    EngineCoreRequest,
    make_encoder,
    make_request_decoder,
)
from tokenserve.messages.multimodal import MultiModalFeature
from tokenserve.multimodal.hasher import hash_image
from tokenserve.multimodal.tensors import from_tensor_data, to_tensor_data
from tokenserve.sampling_params import SamplingParams


def feature(identifier: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature("image", identifier, offset, length)


def request(request_id: str, *features: MultiModalFeature, num_tokens: int = 64) -> Request:
    return Request(request_id, list(range(num_tokens)), SamplingParams(), None,
                   mm_features=list(features))


def block_hashes(*spans: tuple[int, int, str]) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(get_hash_function("sha256"), hashes, list(range(64)), 16, None, None, spans)
    return hashes


def test_image_hash_is_a_block_hash_extra_key():
    plain = block_hashes()
    image_a = block_hashes((20, 8, "a"))
    # Blocks before the image are shared; from the block that holds it on, they differ.
    assert image_a[0] == plain[0]
    assert all(x != y for x, y in zip(image_a[1:], plain[1:]))
    assert block_hashes((20, 8, "a")) == image_a
    image_b = block_hashes((20, 8, "b"))
    assert image_b[0] == image_a[0] and all(x != y for x, y in zip(image_b[1:], image_a[1:]))


def test_image_hash_follows_pixels_mode_and_size():
    image = random_image(1)
    assert hash_image(image) == hash_image(random_image(1))
    assert hash_image(image) != hash_image(random_image(2))
    assert hash_image(image) != hash_image(image.convert("RGBA"))
    assert hash_image(image) != hash_image(image.resize((52, 40)))


def test_unreferenced_outputs_stay_until_space_is_needed():
    cache = EncoderCacheManager(cache_size=20)
    first = request("r1", feature("a", 0, 10))
    cache.allocate(first, 0)
    cache.free(first)  # the request is done with it, the output stays
    second = request("r2", feature("a", 5, 10))
    assert cache.has_cache("a")
    cache.add_reference(second, 0)  # reused, and referenced again
    third = request("r3", feature("b", 0, 10), feature("c", 20, 10))
    cache.allocate(third, 0)
    # "a" is referenced by r2: there is no room for "c" beside "a" and "b".
    assert not cache.can_allocate(10, reserved=0)
    cache.free(second)
    assert cache.can_allocate(10, reserved=0)
    cache.allocate(third, 1)
    assert cache.get_freed_mm_hashes() == ["a"]  # evicted: the workers drop it
    assert not cache.has_cache("a")


def test_chunk_stops_before_an_image_over_the_budget():
    cache = EncoderCacheManager(cache_size=100)
    plan = EncoderPlan(budget=12)
    req = request("r", feature("a", 4, 8), feature("b", 20, 8))
    # Image "a" fits the budget; "b" would exceed it: the chunk ends where "b" starts.
    num_new_tokens, inputs = schedule_encoder_inputs(cache, plan, req, 0, 40)
    assert (num_new_tokens, inputs.to_encode) == (20, [0])
    commit_encoder_inputs(cache, plan, req, inputs)
    assert plan.inputs == {"r": [0]} and plan.budget == 4
    # Computed past "a": only "b" is needed, and an image alone in a step always runs.
    req.num_computed_tokens = 20
    num_new_tokens, inputs = schedule_encoder_inputs(cache, EncoderPlan(4), req, 20, 20)
    assert (num_new_tokens, inputs.to_encode) == (20, [1])


def test_a_request_not_scheduled_holds_no_reference():
    cache = EncoderCacheManager(cache_size=10)
    owner = request("r1", feature("a", 0, 10))
    cache.allocate(owner, 0)
    cache.free(owner)
    reader = request("r2", feature("a", 0, 10), feature("b", 12, 10))
    # The chunk reads "a" (held); "b" does not fit beside it: the chunk stops before "b".
    num_new_tokens, inputs = schedule_encoder_inputs(cache, EncoderPlan(100), reader, 0, 30)
    assert (num_new_tokens, inputs.reused, inputs.to_encode) == (12, [0], [])
    # Planned but not committed (the request was not scheduled): "a" stays evictable.
    assert cache.freeable == {"a": 10}
    commit_encoder_inputs(cache, EncoderPlan(100), reader, inputs)
    assert cache.freeable == {} and cache.cached["a"] == {"r2"}


def test_features_cross_the_wire():
    pixels = torch.randn(1, 3, 8, 8)
    mask = torch.ones(1, 8, 8, dtype=torch.bool)
    sent = MultiModalFeature(
        "image", "abc", 3, 5, {"pixel_values": to_tensor_data(pixels),
                               "pixel_attention_mask": to_tensor_data(mask)},
        embed_mask=[True, False, True, True, True],
    )
    message = EngineCoreRequest("r", [1, 2, 3], SamplingParams(), None, 0.0, mm_features=[sent])
    received = make_request_decoder().decode(make_encoder().encode(message)).mm_features[0]
    assert received.num_embeds == 4 and (received.offset, received.length) == (3, 5)
    assert torch.equal(from_tensor_data(received.data["pixel_values"]), pixels)
    assert torch.equal(from_tensor_data(received.data["pixel_attention_mask"]), mask)
