"""Steps that bring a request several new tokens: draft tokens scheduled after a decode row's
last token, the stop checks walking the new tokens in order, rejected drafts rolled back.

The model is a stand-in: tests hand `update_from_output` the tokens a verifying runner
would return (the accepted drafts, then one more token).
"""

from __future__ import annotations

import random
from concurrent.futures import Future

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenserve.config import CacheConfig, SchedulerConfig
from tokenserve.core.request import Request
from tokenserve.core.scheduler import Scheduler
from tokenserve.messages.model_runner_output import ModelRunnerOutput
from tokenserve.sample.logprobs import LogprobsLists
from tokenserve.sampling_params import SamplingParams
from tokenserve.structured_output.request import StructuredOutputRequest

from .invariants import check_block_pool_invariants

EOS = 0
BLOCK_SIZE = 4


def make_scheduler(num_blocks=16, budget=64, max_model_len=64, caching=True):
    return Scheduler(
        SchedulerConfig(budget, 8, max_model_len, True, "fcfs", admission_lookahead_tokens=0),
        CacheConfig(BLOCK_SIZE, num_blocks, caching, "sha256"),
    )


def add(scheduler, request_id="r", prompt=(1, 2, 3), **params):
    params.setdefault("max_tokens", 16)
    request = Request(request_id, list(prompt), SamplingParams(**params), eos_token_id=EOS)
    scheduler.add_request(request)
    return request


def runner_output(sampled: dict[str, list[int]], logprobs=None) -> ModelRunnerOutput:
    return ModelRunnerOutput(list(sampled), list(sampled.values()), logprobs or {})


def prefill(scheduler, request, first_token=5):
    """Compute the prompt and sample the first token: the request becomes a decode row."""
    output = scheduler.schedule()
    assert output.num_scheduled_tokens[request.request_id] == request.num_tokens
    scheduler.update_from_output(output, runner_output({request.request_id: [first_token]}))
    assert request.num_tokens - request.num_computed_tokens == 1


def verify_step(scheduler, request, drafts, generated, logprobs=None):
    """One step of a decode row with `drafts`; the runner answers `generated`."""
    scheduler.update_draft_token_ids({request.request_id: drafts})
    output = scheduler.schedule()
    outputs = scheduler.update_from_output(
        output, runner_output({request.request_id: generated}, logprobs)
    )
    check_block_pool_invariants(scheduler.kv_cache_manager)
    return output, outputs


def test_a_decode_row_is_scheduled_with_its_drafts():
    scheduler = make_scheduler()
    request = add(scheduler)
    prefill(scheduler, request)
    scheduler.update_draft_token_ids({"r": [7, 8, 9]})
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"r": 4}
    assert output.scheduled_spec_decode_tokens == {"r": [7, 8, 9]}
    # The step consumes the drafts: the next one has none unless a proposer gives more.
    assert request.spec_token_ids == []
    scheduler.update_from_output(output, runner_output({"r": [7, 8, 9, 10]}))
    assert request.output_token_ids == [5, 7, 8, 9, 10]
    assert request.num_computed_tokens == request.num_tokens - 1
    assert scheduler.schedule().num_scheduled_tokens == {"r": 1}


def test_seeded_random_rows_take_drafts():
    """The rejection sampler verifies seeded random rows exactly: their drafts are scheduled."""
    scheduler = make_scheduler()
    seeded = add(scheduler, "seeded", temperature=1.0, seed=3)
    seeded_greedy = add(scheduler, "seeded-greedy", prompt=(4, 5, 6), temperature=0.0, seed=3)
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner_output({"seeded": [5], "seeded-greedy": [5]}))
    scheduler.update_draft_token_ids({"seeded": [7, 8], "seeded-greedy": [7, 8]})
    assert seeded.spec_token_ids == [7, 8] and seeded_greedy.spec_token_ids == [7, 8]
    assert scheduler.schedule().num_scheduled_tokens == {"seeded": 3, "seeded-greedy": 3}


def test_a_grammar_keeps_only_the_drafts_it_accepts():
    scheduler = make_scheduler()
    request = add(scheduler, ignore_eos=True)
    grammar: Future = Future()
    grammar.set_result(FakeGrammar(terminal_token=8, refused=9))
    request.structured_output_request = StructuredOutputRequest(grammar, stop_token_ids=[8])
    assert request.structured_output_request.poll_grammar()
    prefill(scheduler, request)
    scheduler.update_draft_token_ids({"r": [7, 9, 7]})
    assert request.spec_token_ids == [7]
    scheduler.update_draft_token_ids({"r": [7, 8, 7]})  # nothing after the grammar ends
    assert request.spec_token_ids == [7, 8]
    # Walking the drafts left the grammar where the sampled tokens put it.
    assert request.structured_output_request.matcher.accepted == [5]


def test_rejected_drafts_are_rolled_back_and_the_row_goes_on():
    scheduler = make_scheduler()
    request = add(scheduler)
    prefill(scheduler, request)
    # Only the first of three drafts is accepted; the model's own token follows it.
    _, [core_output] = verify_step(scheduler, request, [7, 8, 9], [7, 11])
    assert core_output.new_token_ids == [7, 11] and core_output.finish_reason is None
    assert request.output_token_ids == [5, 7, 11]
    assert request.num_computed_tokens == request.num_tokens - 1
    assert scheduler.schedule().num_scheduled_tokens == {"r": 1}


def test_eos_among_the_new_tokens_ends_the_request_there():
    scheduler = make_scheduler()
    request = add(scheduler)
    prefill(scheduler, request)
    _, [core_output] = verify_step(scheduler, request, [7, EOS], [7, EOS, 12])
    assert core_output.new_token_ids == [7, EOS]
    assert core_output.finish_reason == "stop"
    assert request.output_token_ids == [5, 7, EOS]
    assert "r" not in scheduler.requests
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 16
    assert not scheduler.has_unfinished_requests()


def test_logprobs_of_dropped_tokens_are_dropped_too():
    scheduler = make_scheduler()
    request = add(scheduler, logprobs=0)
    prefill(scheduler, request)
    logprobs = LogprobsLists([[7], [EOS], [12]], [[-0.1], [-0.2], [-0.3]], [1, 1, 1])
    _, [core_output] = verify_step(scheduler, request, [7, EOS], [7, EOS, 12], {"r": logprobs})
    assert core_output.new_logprobs == LogprobsLists([[7], [EOS]], [[-0.1], [-0.2]], [1, 1])


def test_max_tokens_within_the_new_tokens_truncates_them():
    scheduler = make_scheduler()
    request = add(scheduler, max_tokens=3)
    prefill(scheduler, request)
    _, [core_output] = verify_step(scheduler, request, [7, 8, 9], [7, 8, 9, 10])
    assert core_output.new_token_ids == [7, 8]
    assert core_output.finish_reason == "length"
    assert request.output_token_ids == [5, 7, 8]
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 16


def test_a_stop_token_id_within_the_new_tokens_ends_the_request_with_its_reason():
    scheduler = make_scheduler()
    request = add(scheduler, stop_token_ids=[8])
    prefill(scheduler, request)
    _, [core_output] = verify_step(scheduler, request, [7, 8, 9], [7, 8, 9, 10])
    assert core_output.new_token_ids == [7, 8]
    assert (core_output.finish_reason, core_output.stop_reason) == ("stop", 8)


def test_eos_before_min_tokens_does_not_stop_but_a_later_one_does():
    scheduler = make_scheduler()
    # Output [5, EOS, 7, EOS, 9]: the first EOS is the 2nd output token (< min_tokens=3).
    request = add(scheduler, min_tokens=3)
    prefill(scheduler, request)
    _, [core_output] = verify_step(scheduler, request, [EOS, 7, EOS], [EOS, 7, EOS, 9])
    assert core_output.new_token_ids == [EOS, 7, EOS]
    assert core_output.finish_reason == "stop"


def test_max_model_len_within_the_new_tokens_caps_the_request():
    # 3 prompt tokens + the first output: 4 tokens; max_model_len 6 leaves room for 2 more.
    scheduler = make_scheduler(max_model_len=6)
    request = add(scheduler)
    prefill(scheduler, request)
    scheduler.update_draft_token_ids({"r": [7, 8, 9]})
    output = scheduler.schedule()
    # No draft at a position a request never computes: positions 3 and 4, not 5 and 6.
    assert output.scheduled_spec_decode_tokens == {"r": [7]}
    [core_output] = scheduler.update_from_output(output, runner_output({"r": [7, 8]}))
    assert core_output.new_token_ids == [7, 8] and core_output.finish_reason == "length"
    assert request.num_tokens == 6


def test_the_token_budget_trims_drafts_never_the_last_token():
    scheduler = make_scheduler(budget=3)
    request = add(scheduler, prompt=(1, 2))
    prefill(scheduler, request)
    scheduler.update_draft_token_ids({"r": [7, 8, 9]})
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"r": 3}
    assert output.scheduled_spec_decode_tokens == {"r": [7, 8]}


def test_decode_rows_with_drafts_come_before_prompt_chunks():
    scheduler = make_scheduler(budget=8)
    request = add(scheduler, "a")
    prefill(scheduler, request)
    add(scheduler, "b", prompt=range(20, 40))
    scheduler.update_draft_token_ids({"a": [7, 8, 9]})
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 4, "b": 4}
    assert output.scheduled_spec_decode_tokens == {"a": [7, 8, 9]}


def test_grammar_termination_within_the_new_tokens_ends_the_request():
    scheduler = make_scheduler()
    request = add(scheduler, ignore_eos=True)
    grammar: Future = Future()
    grammar.set_result(FakeGrammar(terminal_token=8))
    request.structured_output_request = StructuredOutputRequest(grammar, stop_token_ids=[8])
    assert request.structured_output_request.poll_grammar()
    prefill(scheduler, request)
    # The grammar ends at 8: draft 9 is not even scheduled.
    output, [core_output] = verify_step(scheduler, request, [7, 8, 9], [7, 8, 10])
    assert output.scheduled_spec_decode_tokens == {"r": [7, 8]}
    assert core_output.new_token_ids == [7, 8] and core_output.finish_reason == "stop"
    # The grammar saw the kept tokens, each once, and nothing after the stop.
    assert request.structured_output_request.matcher.accepted == [5, 7, 8]


def test_only_verified_tokens_enter_the_prefix_cache():
    scheduler = make_scheduler()
    request = add(scheduler, prompt=(1, 2))
    prefill(scheduler, request, first_token=3)  # tokens [1, 2, 3]
    # Drafts 9, 9 fill the first block's last slot and more; both are rejected: token 4.
    verify_step(scheduler, request, [9, 9], [4])
    verify_step(scheduler, request, [], [6])  # computes token 4: block [1, 2, 3, 4] is full
    manager = scheduler.kv_cache_manager
    verified = Request("v", [1, 2, 3, 4, 6], SamplingParams(), eos_token_id=EOS)
    draft = Request("d", [1, 2, 3, 9, 6], SamplingParams(), eos_token_id=EOS)
    assert manager.get_computed_blocks(verified)[1] == BLOCK_SIZE
    assert manager.get_computed_blocks(draft)[1] == 0


class FakeMatcher:
    def __init__(self, terminal_token: int, refused: int | None = None) -> None:
        self.terminal_token = terminal_token
        self.refused = refused
        self.accepted: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        if token_id == self.refused:
            return False
        self.accepted.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            del self.accepted[-num_tokens:]

    def is_terminated(self) -> bool:
        return self.accepted[-1:] == [self.terminal_token]


class FakeGrammar:
    def __init__(self, terminal_token: int, refused: int | None = None) -> None:
        self.terminal_token = terminal_token
        self.refused = refused

    def new_matcher(self, stop_token_ids: list[int]) -> FakeMatcher:
        return FakeMatcher(self.terminal_token, self.refused)


# ---- drafts never change outputs ------------------------------------------------------

VOCAB = 4  # token 0 is EOS


def model_token(token_ids: list[int]) -> int:
    """The stand-in model: the next token is a function of the request's tokens so far."""
    return (sum(token_ids) * 7 + len(token_ids) * 3) % VOCAB


def run(workload, budget, num_blocks, seed: int | None) -> dict[str, tuple[list[int], str]]:
    """Run `workload` to the end: each request's output tokens and finish reason. With a
    seed, a proposer gives decode rows random drafts (often right), and the runner verifies
    them as a rejection sampler does greedy rows: drafts are kept while they equal the
    model's token, then one more token comes."""
    rng = random.Random(seed)
    scheduler = Scheduler(
        SchedulerConfig(budget, 4, 32, True, "fcfs", admission_lookahead_tokens=0),
        CacheConfig(BLOCK_SIZE, num_blocks, True, "sha256"),
    )
    for index, (prompt, max_tokens, min_tokens) in enumerate(workload):
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens))
        scheduler.add_request(Request(f"r{index}", prompt, params, eos_token_id=EOS))
    outputs: dict[str, tuple[list[int], str]] = {}
    for _ in range(1000):
        if not scheduler.has_unfinished_requests():
            break
        if seed is not None:
            scheduler.update_draft_token_ids(propose(scheduler, rng))
        output = scheduler.schedule()
        sampled = {}
        for request_id in output.num_scheduled_tokens:
            request = scheduler.requests[request_id]
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prompt chunk short of the end
            sampled[request_id] = verify(
                request.all_token_ids, output.scheduled_spec_decode_tokens.get(request_id, [])
            )
        for core_output in scheduler.update_from_output(output, runner_output(sampled)):
            request_id = core_output.request_id
            tokens, _ = outputs.get(request_id, ([], None))
            outputs[request_id] = (tokens + core_output.new_token_ids, core_output.finish_reason)
            request = scheduler.requests.get(request_id)
            assert request is None or request.num_computed_tokens == request.num_tokens - 1
        check_block_pool_invariants(scheduler.kv_cache_manager)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == num_blocks
    return outputs


def verify(token_ids: list[int], drafts: list[int]) -> list[int]:
    """The model's tokens after `token_ids` while they equal the drafts, and one more."""
    tokens = list(token_ids)
    new_tokens: list[int] = []
    for draft in [*drafts, None]:
        new_tokens.append(model_token(tokens))
        tokens.append(new_tokens[-1])
        if draft != new_tokens[-1]:
            break
    return new_tokens


def propose(scheduler: Scheduler, rng: random.Random) -> dict[str, list[int]]:
    """Drafts for most running requests: 1-4 tokens, each the model's own token 70 % of
    the time (a request still computing its prompt has them dropped by its next step)."""
    drafts = {}
    for request in scheduler.running:
        if rng.random() < 0.3:
            continue
        tokens = list(request.all_token_ids)
        for _ in range(rng.randint(1, 4)):
            right = model_token(tokens)
            tokens.append(right if rng.random() < 0.7 else rng.randrange(VOCAB))
        drafts[request.request_id] = tokens[request.num_tokens :]
    return drafts


workloads = st.lists(
    st.tuples(
        st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12),
        st.integers(1, 16),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workload=workloads,
    budget=st.integers(1, 16),
    num_blocks=st.integers(8, 16),
    seed=st.integers(0, 2**16),
)
def test_drafts_never_change_what_requests_output(workload, budget, num_blocks, seed):
    """Under KV pressure (preemption) and chunked prefill, with stops inside accepted runs:
    the same tokens and finish reasons as one token per step, and every block free at the end."""
    plain = run(workload, budget, num_blocks, seed=None)
    assert set(plain) == {f"r{index}" for index in range(len(workload))}
    assert run(workload, budget, num_blocks, seed) == plain
