"""The scheduler with a KV connector (the real Scheduler; the connector an in-memory fake):
external hits count as computed at admission, past the local prefix-cache hit, and go to
the blocks after it; each step's completed blocks are offered for saving; a load the
workers report failed makes the request start over without its blocks in the prefix cache.
"""

from __future__ import annotations

from tokenserve.config import CacheConfig, KVTransferConfig, SchedulerConfig
from tokenserve.core.request import Request, RequestStatus
from tokenserve.core.scheduler import Scheduler
from tokenserve.kv_transfer.base import KVConnectorMetadata, KVConnectorScheduler
from tokenserve.messages.model_runner_output import KVConnectorOutput, ModelRunnerOutput
from tokenserve.sampling_params import SamplingParams

from .invariants import check_block_pool_invariants

BLOCK_SIZE = 4


class FakeStoreConnector(KVConnectorScheduler):
    """Holds block hashes; 'loads' whatever it holds, 'saves' what it is offered."""

    def __init__(self) -> None:
        super().__init__(KVTransferConfig("Fake"), BLOCK_SIZE)
        self.stored: set[bytes] = set()
        self.allocated: dict[str, list[int]] = {}
        self.saved: list[tuple[int, bytes]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        first = num_computed_tokens // BLOCK_SIZE
        last = (request.num_tokens - 1) // BLOCK_SIZE
        count = 0
        for block_hash in request.block_hashes[first:last]:
            if block_hash not in self.stored:
                break
            count += 1
        return count * BLOCK_SIZE, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocated[request.request_id] = list(block_ids)

    def build_connector_meta(self, scheduled):
        for item in scheduled:
            first = item.num_computed_before // BLOCK_SIZE
            last = min(item.num_computed_after, item.request.num_tokens) // BLOCK_SIZE
            for index in range(first, last):
                self.saved.append((item.block_ids[index], item.request.block_hashes[index]))
        return KVConnectorMetadata()


def make_scheduler(connector, num_blocks=16, budget=64):
    return Scheduler(
        SchedulerConfig(budget, 8, num_blocks * BLOCK_SIZE, True, "fcfs",
                        admission_lookahead_tokens=0),
        CacheConfig(BLOCK_SIZE, num_blocks, True, "sha256"),
        kv_connector=connector,
    )


def add(scheduler, request_id, tokens, max_tokens=2):
    request = Request(request_id, list(tokens),
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=None)
    scheduler.add_request(request)
    return request


def step(scheduler, failed=frozenset()):
    output = scheduler.schedule()
    sampled = {
        rid: [1]
        for rid in output.num_scheduled_tokens
        if scheduler.requests[rid].num_computed_tokens == scheduler.requests[rid].num_tokens
    }
    runner_output = ModelRunnerOutput(list(sampled), list(sampled.values()))
    runner_output.kv_connector_output = KVConnectorOutput(failed_recving=set(failed))
    outputs = scheduler.update_from_output(output, runner_output)
    check_block_pool_invariants(scheduler.kv_cache_manager)
    return output, outputs


def finish_all(scheduler):
    while scheduler.has_unfinished_requests():
        step(scheduler)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_external_hit_counts_as_computed_and_goes_after_the_local_hit():
    connector = FakeStoreConnector()
    scheduler = make_scheduler(connector)
    prompt = list(range(100, 118))  # 4 full blocks + 2 tokens
    first = add(scheduler, "first", prompt[:9])  # computes blocks 0 and 1 locally
    finish_all(scheduler)
    assert connector.saved and {h for _, h in connector.saved} >= set(first.block_hashes[:2])
    # The store holds blocks 0-3 of the longer prompt (its hashes: same chain).
    probe = Request("probe", prompt, SamplingParams(), None)
    scheduler.kv_cache_manager._update_block_hashes(probe, len(prompt))
    connector.stored = set(probe.block_hashes)

    request = add(scheduler, "second", prompt)
    output, _ = step(scheduler)
    # Local hit: blocks 0-1 (8 tokens); external: blocks 2-3 (8 tokens); 2 left to compute.
    assert output.num_scheduled_tokens == {"second": 2}
    assert output.scheduled_new_reqs[0].num_computed_tokens == 16
    assert request.num_cached_tokens == 16
    blocks = scheduler.kv_cache_manager.get_block_ids("second")
    assert connector.allocated["second"] == blocks[2:4]
    assert connector.stats.external_prefix_cache_hits == 8
    finish_all(scheduler)


def test_at_least_one_token_is_left_to_compute():
    connector = FakeStoreConnector()
    scheduler = make_scheduler(connector)
    prompt = list(range(200, 208))  # exactly two blocks
    probe = Request("probe", prompt, SamplingParams(), None)
    scheduler.kv_cache_manager._update_block_hashes(probe, len(prompt))
    connector.stored = set(probe.block_hashes)
    add(scheduler, "r", prompt)
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"r": 4}  # the last block is computed
    finish_all(scheduler)


def test_a_failed_load_recomputes_and_leaves_no_cached_block():
    connector = FakeStoreConnector()
    scheduler = make_scheduler(connector)
    prompt = list(range(300, 314))
    probe = Request("probe", prompt, SamplingParams(), None)
    scheduler.kv_cache_manager._update_block_hashes(probe, len(prompt))
    connector.stored = set(probe.block_hashes)
    request = add(scheduler, "r", prompt)
    output, outputs = step(scheduler, failed={"r"})
    assert output.num_scheduled_tokens == {"r": 2}
    assert outputs == []  # its sampled token is dropped
    assert request.status == RequestStatus.PREEMPTED and request.num_computed_tokens == 0
    pool = scheduler.kv_cache_manager.block_pool
    assert all(pool.get_cached_block(h) is None for h in probe.block_hashes)
    assert pool.num_free_blocks == pool.num_blocks
    assert connector.stats.failed_loads == 1
    connector.stored = set()  # the bad files are gone
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"r": 14}
    assert request.num_cached_tokens == 0
    finish_all(scheduler)


def test_abort_frees_every_block():
    connector = FakeStoreConnector()
    scheduler = make_scheduler(connector)
    prompt = list(range(400, 420))
    add(scheduler, "r", prompt, max_tokens=50)
    step(scheduler)
    scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
