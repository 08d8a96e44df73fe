"""The worker: owns its model runner and executes what a real scheduler decides."""

from __future__ import annotations

import pytest

from tokenserve.core.request import Request
from tokenserve.core.scheduler import Scheduler
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.sampling_params import SamplingParams
from tokenserve.worker.worker import Worker


@pytest.fixture(scope="module")
def config(tiny_model_dirs):
    return EngineArgs(
        model=tiny_model_dirs["qwen2"], kv_cache_memory="8MiB", block_size=16
    ).create_engine_config()


@pytest.fixture(scope="module")
def worker(config):
    worker = Worker(config)
    worker.load_model()
    worker.initialize_kv_cache()
    return worker


def test_each_sampled_request_gets_a_list_of_new_tokens_with_a_logprob_each(config, worker):
    scheduler = Scheduler(config.scheduler_config, config.cache_config)
    for request_id, prompt in (("a", [5, 6, 7]), ("b", list(range(10, 30)))):
        params = SamplingParams(max_tokens=2, logprobs=1)
        scheduler.add_request(Request(request_id, prompt, params, eos_token_id=None))
    for _ in range(2):
        scheduler_output = scheduler.schedule()
        output = worker.execute_model(scheduler_output)
        assert output.req_ids == ["a", "b"]
        assert [len(tokens) for tokens in output.sampled_token_ids] == [1, 1]
        assert [len(output.logprobs[request_id]) for request_id in output.req_ids] == [1, 1]
        core_outputs = scheduler.update_from_output(scheduler_output, output)
        assert [o.new_token_ids for o in core_outputs] == output.sampled_token_ids
    assert not scheduler.has_unfinished_requests()


def test_a_step_with_drafts_returns_the_accepted_drafts_and_one_token(config, worker):
    scheduler = Scheduler(config.scheduler_config, config.cache_config)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
    scheduler.add_request(Request("a", [5, 6, 7], params, eos_token_id=None))
    scheduler_output = scheduler.schedule()
    first = worker.execute_model(scheduler_output)
    scheduler.update_from_output(scheduler_output, first)
    scheduler.update_draft_token_ids({"a": [1, 2]})
    scheduler_output = scheduler.schedule()
    assert scheduler_output.scheduled_spec_decode_tokens == {"a": [1, 2]}
    output = worker.execute_model(scheduler_output)
    [tokens] = output.sampled_token_ids
    assert 1 <= len(tokens) <= 3 and tokens[:-1] == [1, 2][: len(tokens) - 1]
    assert len(output.logprobs["a"]) == len(tokens)
    scheduler.update_from_output(scheduler_output, output)
    while scheduler.has_unfinished_requests():
        scheduler_output = scheduler.schedule()
        scheduler.update_from_output(scheduler_output, worker.execute_model(scheduler_output))
