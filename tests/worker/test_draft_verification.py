"""Steps that verify draft tokens, end to end: the engine core on the tiny llama model, a test
"proposer" calling `scheduler.update_draft_token_ids` after every step.

Greedy rows must give, with drafts, exactly the tokens they give without: right drafts are
all accepted (fewer steps), wrong ones are replaced by the model's own token.
"""

from __future__ import annotations

import pytest

from tokenserve.core.engine_core import EngineCore
from tokenserve.core.request import Request
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.sample.rejection_sampler import accept_greedy
from tokenserve.sampling_params import SamplingParams

from ..core.invariants import check_block_pool_invariants

MAX_TOKENS = 12
PROMPTS = {
    "a": [5, 6, 7, 8, 9],
    "b": list(range(20, 33)),
    "c": [3, 1, 4, 1, 5, 9, 2, 6],
}
# A long prompt admitted while the others decode: its prefill takes several chunks.
LATE_PROMPT = list(range(40, 110))


@pytest.fixture(scope="module")
def core(tiny_model_dirs):
    config = EngineArgs(
        model=tiny_model_dirs["llama"],
        kv_cache_memory="8MiB",
        block_size=16,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    ).create_engine_config()
    core = EngineCore(config)
    core.recorder = Recorder(core)
    yield core
    core.shutdown()


def _params(request_id: str, **extra) -> SamplingParams:
    if request_id == "c":
        # Per-token sampling state: the draft positions must see the drafts before them.
        extra = {"repetition_penalty": 1.5, "frequency_penalty": 0.5, **extra}
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, **extra)


class Recorder:
    """Wraps the engine core's executor: checks each runner output's logprobs (one position
    per new token, for the tokens returned), keeps them per request, and notes whether a
    step verified drafts while another request computed a prompt chunk."""

    def __init__(self, core) -> None:
        self.logprobs: dict[str, list] = {}
        self.saw_drafts_with_chunk = False
        execute = core.executor.execute_model

        def recording(scheduler_output, *args, **kwargs):
            output = execute(scheduler_output, *args, **kwargs)
            drafts = scheduler_output.scheduled_spec_decode_tokens
            chunks = [
                request_id
                for request_id, count in scheduler_output.num_scheduled_tokens.items()
                if count > 1 and request_id not in drafts
            ]
            if drafts and chunks:
                self.saw_drafts_with_chunk = True
            for request_id, tokens in zip(output.req_ids, output.sampled_token_ids):
                if request_id not in output.logprobs:
                    continue
                lists = output.logprobs[request_id]
                assert len(lists) == len(tokens), "one logprobs position per new token"
                assert [ids[0] for ids in lists.token_ids] == tokens
                self.logprobs.setdefault(request_id, []).extend(lists.logprobs)
            return output

        core.executor.execute_model = recording


def run(core, propose=None):
    """Run PROMPTS, and LATE_PROMPT added after the first step, to the end; before each step
    `propose(request_id, output_so_far)` gives the drafts of each running request that has
    sampled. Returns the tokens and logprobs per request and the number of steps."""
    scheduler = core.scheduler
    recorder = core.recorder
    recorder.logprobs.clear()
    recorder.saw_drafts_with_chunk = False
    for request_id, prompt in PROMPTS.items():
        core.add_request(Request(request_id, prompt, _params(request_id), eos_token_id=None))
    tokens: dict[str, list[int]] = {}
    steps = 0
    while core.has_unfinished_requests():
        if propose is not None:
            scheduler.update_draft_token_ids(
                {
                    r.request_id: propose(r.request_id, list(r.output_token_ids))
                    for r in scheduler.running
                    if r.num_output_tokens > 0
                }
            )
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        steps += 1
        if steps == 1:
            core.add_request(Request("late", LATE_PROMPT, _params("late"), eos_token_id=None))
        check_block_pool_invariants(scheduler.kv_cache_manager)
    manager = scheduler.kv_cache_manager
    assert not manager.req_to_blocks
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    # The runner may return tokens past max_tokens; the scheduler drops them.
    logprobs = {r: recorder.logprobs[r][: len(t)] for r, t in tokens.items()}
    return tokens, logprobs, steps


@pytest.fixture(scope="module")
def reference(core):
    tokens, logprobs, steps = run(core)
    assert sorted(tokens) == ["a", "b", "c", "late"]
    assert all(len(t) == MAX_TOKENS for t in tokens.values())
    return tokens, logprobs, steps


def _same_logprobs(got, expected):
    assert len(got) == len(expected)
    for got_row, expected_row in zip(got, expected):
        assert got_row == pytest.approx(expected_row, abs=1e-4)


def test_right_drafts_are_all_accepted_and_take_fewer_steps(core, reference):
    expected, expected_logprobs, reference_steps = reference

    def propose(request_id, output):
        return expected[request_id][len(output) : len(output) + 3]

    tokens, logprobs, steps = run(core, propose)
    assert tokens == expected
    for request_id in expected:
        _same_logprobs(logprobs[request_id], expected_logprobs[request_id])
    assert steps < reference_steps


def test_wrong_drafts_give_the_tokens_of_a_run_without_drafts(core, reference):
    expected, expected_logprobs, _ = reference
    vocab_size = core.config.model_config.vocab_size

    def propose(request_id, output):
        truth = expected[request_id][len(output) : len(output) + 4]
        return [(token + 1) % vocab_size for token in truth]

    tokens, logprobs, _ = run(core, propose)
    assert tokens == expected
    for request_id in expected:
        _same_logprobs(logprobs[request_id], expected_logprobs[request_id])


def test_a_mix_of_right_and_wrong_drafts_alongside_a_chunked_prefill(core, reference):
    expected, expected_logprobs, _ = reference

    def propose(request_id, output):
        truth = expected[request_id][len(output) : len(output) + 4]
        if request_id == "a":
            return truth  # all right
        if request_id == "b":
            return truth[:2] + [(t + 3) % 50 for t in truth[2:]]  # right, then wrong
        if request_id == "late":
            return truth[:1] + [7, 7]
        return [(t + 1) % 50 for t in truth[:1]] + truth[1:]  # wrong first: none taken

    tokens, logprobs, _ = run(core, propose)
    assert tokens == expected
    for request_id in expected:
        _same_logprobs(logprobs[request_id], expected_logprobs[request_id])
    # A step verified drafts while the late request's prompt was computed in chunks.
    assert core.recorder.saw_drafts_with_chunk


def test_verification_rule():
    assert accept_greedy([], [4]) == [4]
    assert accept_greedy([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accept_greedy([1, 2, 3], [1, 5, 3, 4]) == [1, 5]
    assert accept_greedy([1, 2, 3], [6, 2, 3, 4]) == [6]


def test_random_rowsaccept_greedy(core):
    """Unseeded temperature sampling with drafts: the step runs and returns 1 to k + 1
    tokens per row (its distribution is the sampler's; exactness is for greedy)."""
    core.add_request(
        Request("t", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.8), eos_token_id=None)
    )
    total = 0
    while core.has_unfinished_requests():
        core.scheduler.update_draft_token_ids({"t": [1, 2, 3]})
        total += sum(len(o.new_token_ids) for o in core.step())
    assert total == 8


def test_seeded_random_rows_verify_drafts_reproducibly(core):
    """A seeded random row with drafts draws from its own generator only: the same seed and
    the same drafts give the same tokens, whatever else runs."""

    def generate(others: int) -> list[int]:
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
        core.add_request(Request("s", [5, 6, 7], params, eos_token_id=None))
        for index in range(others):
            core.add_request(
                Request(f"o{index}", [9, 8], SamplingParams(max_tokens=8), eos_token_id=None)
            )
        tokens: list[int] = []
        while core.has_unfinished_requests():
            core.scheduler.update_draft_token_ids({"s": [1, 2, 3]})
            for output in core.step():
                if output.request_id == "s":
                    tokens += output.new_token_ids
        return tokens

    alone = generate(0)
    assert len(alone) == 8 and generate(2) == alone
