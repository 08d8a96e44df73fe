"""The sampling parameters end to end on a tiny model: logprobs against transformers,
seeds, stop strings, min_tokens, masks, and n > 1 sharing the prompt's KV blocks."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenserve import LLM, SamplingParams

VOCAB_LOW = 3  # ids below are the special tokens


@pytest.fixture(scope="module")
def llm(tiny_model_dirs) -> LLM:
    return LLM(tiny_model_dirs["llama"], kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dirs["llama"], dtype=torch.float32
    ).eval()


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, 500) for _ in range(length)]


def generate_one(llm: LLM, prompt: list[int], params: SamplingParams):
    [output] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return output


def assert_logprobs_match(entry, token_id: int, reference_row: torch.Tensor, k: int) -> None:
    assert entry[token_id].logprob == pytest.approx(reference_row[token_id].item(), abs=1e-4)
    assert entry[token_id].rank == int((reference_row > reference_row[token_id]).sum()) + 1
    top = reference_row.topk(k)
    for rank, (top_id, top_logprob) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
        assert entry[top_id].logprob == pytest.approx(top_logprob, abs=1e-4)
        assert entry[top_id].rank == rank
    assert len(entry) == k + (token_id not in top.indices.tolist())
    assert entry[token_id].decoded_token is not None


def test_logprobs_equal_transformers(tiny_model_dirs, reference):
    # Chunked prefill (16 tokens a step) so prompt logprobs span several chunks.
    llm = LLM(tiny_model_dirs["llama"], kv_cache_memory="64MiB", max_num_batched_tokens=16)
    prompt = random_prompt(40, seed=1)
    generate_one(llm, prompt, SamplingParams(max_tokens=1))  # put the prompt in the prefix cache
    # Temperature, penalties and top-k change the sampling, not the logprobs returned.
    params = SamplingParams(
        temperature=0.7,
        top_k=20,
        presence_penalty=1.0,
        repetition_penalty=1.3,
        seed=3,
        max_tokens=8,
        ignore_eos=True,
        logprobs=5,
        prompt_logprobs=4,
    )
    output = generate_one(llm, prompt, params)
    assert output.num_cached_tokens == 0  # prompt logprobs skip the prefix cache
    completion = output.outputs[0]
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + completion.token_ids])).logits[0]
    reference_logprobs = logits.float().log_softmax(dim=-1)

    assert len(completion.logprobs) == len(completion.token_ids) == 8
    for i, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert_logprobs_match(entry, token_id, reference_logprobs[len(prompt) - 1 + i], k=5)
    expected_sum = sum(
        reference_logprobs[len(prompt) - 1 + i, t].item()
        for i, t in enumerate(completion.token_ids)
    )
    assert completion.cumulative_logprob == pytest.approx(expected_sum, abs=1e-3)

    assert len(output.prompt_logprobs) == len(prompt)
    assert output.prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        assert_logprobs_match(
            output.prompt_logprobs[position],
            prompt[position],
            reference_logprobs[position - 1],
            k=4,
        )
    assert llm.llm_engine.get_stats().kv_cache_usage == 0.0


def test_logprobs_zero_gives_the_chosen_token_only(llm):
    output = generate_one(
        llm, random_prompt(7, seed=2), SamplingParams(temperature=0, max_tokens=3, logprobs=0)
    )
    for token_id, entry in zip(output.outputs[0].token_ids, output.outputs[0].logprobs):
        assert list(entry) == [token_id] and entry[token_id].rank == 1  # greedy: the top token


def test_seed_gives_the_same_tokens_alone_and_in_a_batch(llm):
    prompt = random_prompt(21, seed=4)
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = generate_one(llm, prompt, target).outputs[0].token_ids
    greedy_alone = generate_one(llm, random_prompt(9, seed=5), greedy).outputs[0].token_ids
    others = [
        SamplingParams(temperature=0.8, top_k=5, max_tokens=5),
        SamplingParams(temperature=1.2, min_p=0.1, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.5, presence_penalty=1.5, frequency_penalty=0.5, max_tokens=9),
        SamplingParams(
            temperature=1.0, repetition_penalty=1.5, logit_bias={10: 5.0}, max_tokens=14
        ),
        SamplingParams(temperature=1.0, allowed_token_ids=[10, 20, 30], max_tokens=3),
        SamplingParams(temperature=0.9, logprobs=3, min_tokens=4, max_tokens=8),
        SamplingParams(temperature=1.0, seed=1234, n=2, max_tokens=6),
        greedy,
    ]
    prompts = [random_prompt(5 + 7 * i, seed=10 + i) for i in range(7)] + [random_prompt(9, seed=5)]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:3] + [prompt] + prompts[3:]],
        others[:3] + [target] + others[3:],
        use_tqdm=False,
    )
    assert outputs[3].outputs[0].token_ids == alone
    assert outputs[-1].outputs[0].token_ids == greedy_alone
    assert all(t in (10, 20, 30) for t in outputs[5].outputs[0].token_ids)
    assert llm.llm_engine.get_stats().kv_cache_usage == 0.0


def clean_token_ids(tokenizer) -> list[int]:
    """Tokens whose text is plain printable ASCII letters and spaces."""
    return [
        token_id
        for token_id in range(VOCAB_LOW, len(tokenizer))
        if (text := tokenizer.decode([token_id])).strip()
        and all(c.isalpha() or c == " " for c in text)
    ]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(llm, include):
    tokenizer = llm.get_tokenizer()
    prompt = random_prompt(11, seed=6)
    base = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        ignore_eos=True,
        allowed_token_ids=clean_token_ids(tokenizer),
    )
    full = generate_one(llm, prompt, base).outputs[0]
    stop = tokenizer.decode(full.token_ids[4:7])  # three tokens
    start = full.text.index(stop)
    # The first token count whose text holds the stop string.
    num_tokens = next(n for n in range(1, 21) if stop in tokenizer.decode(full.token_ids[:n]))
    assert num_tokens - 1 > 0 and stop not in tokenizer.decode(full.token_ids[: num_tokens - 1])

    params = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        ignore_eos=True,
        allowed_token_ids=base.allowed_token_ids,
        stop=[stop],
        include_stop_str_in_output=include,
    )
    completion = generate_one(llm, prompt, params).outputs[0]
    assert completion.text == full.text[: start + len(stop) if include else start]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.token_ids == full.token_ids[:num_tokens]
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.get_stats().kv_cache_usage == 0.0


def test_min_tokens_holds_eos_and_stop_tokens_back(llm):
    eos = llm.get_tokenizer().eos_token_id
    prompt = random_prompt(6, seed=7)
    forced_eos = SamplingParams(temperature=0.0, logit_bias={eos: 100.0}, max_tokens=10)
    assert generate_one(llm, prompt, forced_eos).outputs[0].token_ids == [eos]
    completion = generate_one(
        llm,
        prompt,
        SamplingParams(temperature=0.0, logit_bias={eos: 100.0}, min_tokens=5, max_tokens=10),
    ).outputs[0]
    assert len(completion.token_ids) == 6 and completion.token_ids[-1] == eos
    assert eos not in completion.token_ids[:5]
    assert completion.finish_reason == "stop"

    params = SamplingParams(
        temperature=0.0, logit_bias={42: 100.0}, stop_token_ids=[42], min_tokens=3, max_tokens=10
    )
    completion = generate_one(llm, prompt, params).outputs[0]
    assert len(completion.token_ids) == 4 and completion.token_ids[-1] == 42
    assert completion.finish_reason == "stop" and completion.stop_reason == 42


def test_bad_words_are_never_completed(llm):
    tokenizer = llm.get_tokenizer()
    fr, an = tokenizer.convert_tokens_to_ids(["Fr", "an"])
    assert tokenizer.encode("Fran") == [fr, an]
    prompt = random_prompt(8, seed=8)
    # Only "Fr" and "an" may be sampled; "an" right after "Fr" would complete "Fran".
    params = SamplingParams(
        temperature=1.0,
        seed=0,
        allowed_token_ids=[fr, an],
        bad_words=["Fran"],
        max_tokens=30,
        ignore_eos=True,
    )
    completion = generate_one(llm, prompt, params).outputs[0]
    assert "Fran" not in completion.text
    assert fr in completion.token_ids  # the test saw the prefix at least once


def test_n_samples_share_one_prompt_computation(llm):
    prompt = random_prompt(257, seed=9)  # two full blocks of 128 (the default), then one token
    hits_before = llm.llm_engine.get_stats().prefix_cache_hits
    # Unseeded samples draw from torch's global generator: seeded here, so that the four
    # are the same every run whatever ran before.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        output = generate_one(
            llm, prompt, SamplingParams(n=4, temperature=1.0, max_tokens=16, ignore_eos=True)
        )
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 4
    # Children 2..4 reused the 256 prompt tokens child 1 registered in the same step.
    assert output.num_cached_tokens == 256
    assert llm.llm_engine.get_stats().prefix_cache_hits - hits_before == 3 * 256

    seeded = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    first = [c.token_ids for c in generate_one(llm, prompt, seeded).outputs]
    again = [c.token_ids for c in generate_one(llm, prompt, seeded).outputs]
    assert first == again and len({tuple(t) for t in first}) == 3
    single = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    assert generate_one(llm, prompt, single).outputs[0].token_ids == first[0]


def test_aborting_the_parent_aborts_every_child(llm):
    engine = llm.llm_engine
    engine.add_request(
        "parent",
        {"prompt_token_ids": random_prompt(20, seed=12)},
        SamplingParams(n=3, max_tokens=50),
    )
    engine.step()
    engine.abort_request(["parent"])
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_cache_usage == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(logprobs=21), r"logprobs must be at most max_logprobs=20"),
        (dict(prompt_logprobs=25), r"prompt_logprobs must be at most max_logprobs=20"),
        (dict(logit_bias={100000: 1.0}), r"logit_bias holds token id 100000, out of .*vocabulary"),
        (dict(allowed_token_ids=[1, 100000]), r"allowed_token_ids holds token id 100000"),
        (dict(stop_token_ids=[100000]), r"stop_token_ids holds token id 100000"),
    ],
)
def test_vocabulary_checks_at_the_edge(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["Hello"], SamplingParams(**kwargs), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
