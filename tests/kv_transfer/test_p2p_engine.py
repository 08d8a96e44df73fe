"""P2pConnector between two engines in this process (a prefill producer, a decode consumer,
KV over ZMQ on 127.0.0.1), stepped by the test: the decode's greedy output equals one
engine's, its cached tokens cover the prompt but the last token; an abort during the
transfer, a refused transfer and an unpulled prefill leave every block free on both sides.
"""

from __future__ import annotations

import time

import pytest

from tests.entrypoints.openai.remote_server import free_port
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.engine.llm_engine import LLMEngine
from tokenserve.entrypoints.llm import LLM
from tokenserve.sampling_params import SamplingParams

BLOCK_SIZE = 16
PROMPT = list(range(5, 5 + 2 * BLOCK_SIZE + 9))  # two full blocks and a partial one
SECRET = "a-shared-secret-for-tests"


def engine(model: str, role: str, port: int, secret: str = SECRET, **extra) -> LLMEngine:
    config = {
        "kv_connector": "P2pConnector",
        "kv_role": role,
        "kv_ip": "127.0.0.1",
        "kv_port": port,
        "kv_connector_extra_config": {"secret": secret, **extra},
    }
    return LLMEngine.from_engine_args(EngineArgs(
        model=model, block_size=BLOCK_SIZE, num_kv_blocks=16, kv_transfer_config=config,
    ))


def params(max_tokens: int, kv_transfer_params: dict) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          extra_args={"kv_transfer_params": kv_transfer_params})


def drive(engines: list[LLMEngine], done, timeout_s: float = 120.0) -> dict:
    """Step every engine in turn until `done(finished outputs)`; bounded, not timed."""
    finished: dict = {}
    deadline = time.monotonic() + timeout_s
    while not done(finished):
        assert time.monotonic() < deadline, "the engines did not get there"
        for each in engines:
            for output in each.step():
                if output.finished:
                    finished[output.request_id] = output
    return finished


def all_free(each: LLMEngine) -> bool:
    pool = each.engine_core.scheduler.kv_cache_manager.block_pool
    return pool.num_free_blocks == pool.num_blocks


def settle(engines: list[LLMEngine]) -> None:
    drive(engines, lambda _: not any(e.has_unfinished_requests() for e in engines))
    for each in engines:
        assert all_free(each)
        each.engine_core.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], block_size=BLOCK_SIZE, num_kv_blocks=16)
    [output] = llm.generate({"prompt_token_ids": PROMPT},
                            SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
    return output.outputs[0].token_ids


def prefill(producer: LLMEngine) -> dict:
    producer.add_request("p", {"prompt_token_ids": PROMPT}, params(1, {"do_remote_decode": True}))
    kv_transfer_params = drive([producer], lambda f: "p" in f)["p"].kv_transfer_params
    assert kv_transfer_params["do_remote_prefill"] is True
    assert kv_transfer_params["remote_num_tokens"] == len(PROMPT)
    assert not all_free(producer), "the prefill keeps its blocks for the decode instance"
    return kv_transfer_params


def test_decode_output_equals_one_instance(tiny_model_dirs, reference):
    model = tiny_model_dirs["llama"]
    producer = engine(model, "kv_producer", free_port())
    consumer = engine(model, "kv_consumer", free_port())
    kv_transfer_params = prefill(producer)
    consumer.add_request("d", {"prompt_token_ids": PROMPT}, params(6, kv_transfer_params))
    decoded = drive([producer, consumer], lambda f: "d" in f)["d"]
    assert decoded.outputs[0].token_ids == reference
    assert decoded.num_cached_tokens == len(PROMPT) - 1
    assert consumer.get_stats().kv_connector_stats.bytes_loaded > 0
    assert producer.get_stats().kv_connector_stats.bytes_saved > 0
    settle([producer, consumer])


def test_abort_during_transfer_frees_every_block(tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    producer = engine(model, "kv_producer", free_port())
    consumer = engine(model, "kv_consumer", free_port())
    kv_transfer_params = prefill(producer)
    consumer.add_request("d", {"prompt_token_ids": PROMPT}, params(6, kv_transfer_params))
    consumer.step()  # admitted: its blocks wait for the KV, which the producer has not sent
    assert not all_free(consumer)
    consumer.abort_request(["d"])
    # Blocks under a copy are not freed until the copy ends.
    assert not all_free(consumer)
    settle([producer, consumer])


def test_refused_transfer_ends_the_request_and_frees_both(tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    producer = engine(model, "kv_producer", free_port(), send_timeout_s=1)
    consumer = engine(model, "kv_consumer", free_port(), secret="not-the-same-secret!",
                      transfer_timeout_s=5)
    kv_transfer_params = prefill(producer)
    consumer.add_request("d", {"prompt_token_ids": PROMPT}, params(6, kv_transfer_params))
    decoded = drive([producer, consumer], lambda f: "d" in f)["d"]
    assert decoded.outputs[0].finish_reason == "abort"
    assert decoded.outputs[0].token_ids == []
    assert consumer.get_stats().kv_connector_stats.failed_loads == 1
    settle([producer, consumer])  # the producer lets go after send_timeout_s


def test_a_missing_secret_is_a_value_error(tiny_model_dirs, monkeypatch):
    monkeypatch.delenv("TOKENSERVE_KV_SECRET", raising=False)
    with pytest.raises(ValueError, match="secret"):
        engine(tiny_model_dirs["llama"], "kv_producer", free_port(), secret="")
