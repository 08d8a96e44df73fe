"""The scheduler never lets a step need an image's encoder output that the workers do not
have: under random prompts with shared and distinct images, token and encoder budgets,
small encoder caches and KV pools small enough to preempt (the model replaced by fixed
tokens, the workers' cache followed as they follow the scheduler's messages)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenserve.config import CacheConfig, SchedulerConfig
from tokenserve.core.request import Request
from tokenserve.core.scheduler import Scheduler
from tokenserve.messages.model_runner_output import ModelRunnerOutput
from tokenserve.messages.multimodal import MultiModalFeature
from tokenserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


@st.composite
def workloads(draw):
    requests = []
    for index in range(draw(st.integers(1, 6))):
        tokens, features = 0, []
        for _ in range(draw(st.integers(0, 3))):
            tokens += draw(st.integers(0, 10))  # text before the image
            length = draw(st.integers(1, 12))
            identifier = f"image-{draw(st.integers(0, 3))}"  # a small pool: images repeat
            features.append(MultiModalFeature("image", identifier, tokens, length))
            tokens += length
        tokens += draw(st.integers(1, 6))
        requests.append((f"r{index}", tokens, features, draw(st.integers(1, 6))))
    budget = draw(st.integers(4, 24))
    encoder_budget = draw(st.integers(1, 16))
    cache_size = draw(st.integers(1, 24))
    # max_model_len is the pool's size: every prompt shorter than it, as the engine's input
    # processor requires (a longer one is refused before it reaches the scheduler).
    longest = max(tokens for _, tokens, _, _ in requests)
    num_blocks = draw(st.integers(max(12, longest // BLOCK_SIZE + 1), 40))
    return requests, budget, encoder_budget, cache_size, num_blocks


@settings(max_examples=60, deadline=None)
@given(workloads())
def test_every_needed_encoder_output_is_there(workload):
    requests, budget, encoder_budget, cache_size, num_blocks = workload
    scheduler = Scheduler(
        SchedulerConfig(budget, 8, num_blocks * BLOCK_SIZE, True, "fcfs",
                        admission_lookahead_tokens=0, max_num_encoder_input_tokens=encoder_budget,
                        encoder_cache_size=cache_size),
        CacheConfig(BLOCK_SIZE, num_blocks, True, "sha256"),
    )
    for request_id, num_tokens, features, max_tokens in requests:
        scheduler.add_request(Request(
            request_id, [1000 + i for i in range(num_tokens)],
            SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
            mm_features=features or None,
        ))
    features_of = {request_id: features for request_id, _, features, _ in requests}
    worker_cache: set[str] = set()
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        starts = {rid: r.num_computed_tokens for rid, r in scheduler.requests.items()}
        output = scheduler.schedule()
        for new in output.scheduled_new_reqs:
            starts[new.request_id] = new.num_computed_tokens
        worker_cache -= set(output.free_encoder_mm_hashes)
        encoded = 0
        for request_id, input_ids in output.scheduled_encoder_inputs.items():
            for input_id in input_ids:
                feature = features_of[request_id][input_id]
                if feature.identifier not in worker_cache:
                    encoded += feature.num_embeds
                worker_cache.add(feature.identifier)
        # Within the encoder budget, or one image alone.
        assert encoded <= encoder_budget or sum(
            len(ids) for ids in output.scheduled_encoder_inputs.values()
        ) == 1
        for request_id, count in output.num_scheduled_tokens.items():
            start, end = starts[request_id], starts[request_id] + count
            for feature in features_of[request_id]:
                if feature.offset < end and feature.offset + feature.length > start:
                    assert feature.identifier in worker_cache, (request_id, start, end, feature)
        sampled = {
            rid: [7] for rid in output.num_scheduled_tokens
            if scheduler.requests[rid].num_computed_tokens == scheduler.requests[rid].num_tokens
        }
        scheduler.update_from_output(
            output, ModelRunnerOutput(list(sampled), list(sampled.values()))
        )
    assert not scheduler.has_unfinished_requests()
    # Every request released its images: all that is cached is evictable.
    cache = scheduler.encoder_cache_manager
    assert all(not users for users in cache.cached.values())
    assert set(cache.freeable) == set(cache.cached)
