"""Multi-LoRA in the engine: batches mixing the base model and several adapters are
token-exact per request with peft (adapter applied, not merged); more adapters than
max_loras are served by swapping slots; adapters never share KV blocks; bad adapters are
refused with a ValueError and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.lora.peft_adapters import make_adapter, peft_greedy
from tokenserve import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def lora_requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}


def run(llm: LLM, requests: list[tuple[list[int], LoRARequest | None]]) -> list[list[int]]:
    outputs = llm.generate(
        [{"prompt_token_ids": prompt} for prompt, _ in requests], GREEDY, use_tqdm=False,
        lora_request=[lora for _, lora in requests],
    )
    return [output.outputs[0].token_ids for output in outputs]


def steps_seen(llm: LLM) -> list[list]:
    """Record each step's adapters (per request, None for the base) as the runner sees them."""
    seen: list[list] = []

    def spy(worker) -> None:
        manager = worker.model_runner.lora_manager
        original = manager.set_active_loras

        def recording(lora_requests, num_tokens):
            seen.append(list(lora_requests))
            original(lora_requests, num_tokens)
            assert len(manager.slot_of) <= manager.config.max_loras
            # The fused decode layer knows no adapters: it takes base-only steps only.
            has_adapter = any(lora is not None for lora in lora_requests)
            assert manager.layer_stack.enabled == (manager.fused_enabled and not has_adapter)

        manager.set_active_loras = recording

    llm.llm_engine.collective_rpc(spy)
    return seen


def test_mixed_batch_matches_peft(lora_base, lora_adapters, lora_prompts):
    """Each prompt with the base model and three adapters, all in the same steps."""
    names = [None, "a0", "a1", "a2"]
    adapters = {name: lora_adapters[name] for name in names[1:]}
    requests = [(prompt, name) for prompt in lora_prompts for name in names]
    expected = peft_greedy(lora_base, adapters, requests, MAX_TOKENS)
    llm = LLM(lora_base, kv_cache_memory="64MiB", enable_lora=True, max_loras=3)
    seen = steps_seen(llm)
    loras = lora_requests(adapters)
    got = run(llm, [(prompt, loras.get(name)) for prompt, name in requests])
    assert got == expected
    # The adapters change the output: each prompt's four continuations are not all one.
    for index in range(len(lora_prompts)):
        assert len({tuple(t) for t in expected[4 * index : 4 * index + 4]}) > 1
    # One step held the base model and all three adapters together.
    assert any({lora.lora_name for lora in step if lora} == set(adapters) and None in step
               for step in seen)


def test_more_adapters_than_max_loras_swap_slots(lora_base, lora_adapters, lora_prompts):
    """Four adapters, two slots, two loaded copies: slots and copies are swapped (LRU),
    prompts are chunked across steps, and every request is still token-exact."""
    names = ["a0", "a1", None, "a2", "a3", "a1"]
    requests = [(lora_prompts[i % 3], name) for i, name in enumerate(names)]
    expected = peft_greedy(lora_base, lora_adapters, requests, MAX_TOKENS)
    llm = LLM(
        lora_base, kv_cache_memory="64MiB", enable_lora=True, max_loras=2, max_cpu_loras=2,
        max_num_batched_tokens=16,
    )
    seen = steps_seen(llm)
    loras = lora_requests(lora_adapters)
    got = run(llm, [(prompt, loras.get(name)) for prompt, name in requests])
    assert got == expected
    assert max(len({lora.lora_int_id for lora in step if lora}) for step in seen) == 2
    # The slots ended up holding two of the four adapters: the others were swapped out.
    [slotted] = llm.llm_engine.collective_rpc(
        lambda worker: list(worker.model_runner.lora_manager.slot_of)
    )
    assert len(slotted) == 2


def test_adapters_never_share_kv_blocks(lora_base, lora_adapters, lora_prompts):
    """The same prompt under the base model and two adapters hits the prefix cache only
    within one adapter (the adapter is a block-hash extra key)."""
    prompt = lora_prompts[2]  # 45 tokens: two full blocks of 16
    loras = lora_requests(lora_adapters)
    llm = LLM(lora_base, kv_cache_memory="64MiB", block_size=16, enable_lora=True, max_loras=2)
    seen = steps_seen(llm)
    order = [None, "a0", "a1", "a0", None]
    hits = []
    for name in order:
        before = llm.llm_engine.get_stats().prefix_cache_hits
        [output] = llm.generate(
            {"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=loras.get(name)
        )
        hits.append(llm.llm_engine.get_stats().prefix_cache_hits - before)
        assert output.outputs[0].token_ids == peft_greedy(
            lora_base, {name: lora_adapters[name]} if name else {"a0": lora_adapters["a0"]},
            [(prompt, name)], MAX_TOKENS,
        )[0]
    assert hits == [0, 0, 0, 32, 32]
    assert any(all(lora is None for lora in step) for step in seen)  # base-only steps too


def _broken_copy(source: str, destination, change) -> str:
    shutil.copytree(source, destination)
    change(destination)
    return str(destination)


def test_bad_adapters_are_refused_and_the_engine_keeps_serving(
    lora_base, lora_adapters, lora_prompts, tmp_path
):
    source = lora_adapters["a0"]

    def wrong_shape(directory) -> None:
        tensors = load_file(directory / "adapter_model.safetensors")
        name = next(k for k in tensors if "q_proj.lora_B" in k)
        tensors[name] = torch.zeros(tensors[name].shape[0] + 4, tensors[name].shape[1])
        save_file(tensors, directory / "adapter_model.safetensors")

    def high_rank(directory) -> None:
        config = json.loads((directory / "adapter_config.json").read_text())
        config["r"] = 64
        (directory / "adapter_config.json").write_text(json.dumps(config))

    embedding = make_adapter(lora_base, tmp_path / "embedding", 3, targets=["embed_tokens"])
    cases = {
        "missing": (str(tmp_path / "nowhere"), "is not a directory"),
        "no_config": (
            _broken_copy(source, tmp_path / "nc", lambda d: (d / "adapter_config.json").unlink()),
            "no adapter_config.json",
        ),
        "no_weights": (
            _broken_copy(
                source, tmp_path / "nw", lambda d: (d / "adapter_model.safetensors").unlink()
            ),
            "no adapter_model.safetensors",
        ),
        "rank": (_broken_copy(source, tmp_path / "rank", high_rank), "greater than max_lora_rank"),
        "shape": (_broken_copy(source, tmp_path / "shape", wrong_shape), r"needs \[64, 8\]"),
        "target": (embedding, "not a LoRA A/B weight"),
    }
    llm = LLM(lora_base, kv_cache_memory="64MiB", enable_lora=True, max_lora_rank=16)
    for index, (name, (path, message)) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=message):
            llm.generate([1, 2, 3], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest(name, 100 + index, path))
    good = LoRARequest("a0", 1, source)
    with pytest.raises(ValueError, match="already names the adapter"):
        llm.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=False,
                     lora_request=[good, LoRARequest("other", 1, lora_adapters["a1"])])
    with pytest.raises(ValueError, match="lora_int_id must be at least 1"):
        LoRARequest("zero", 0, source)
    # Nothing of the refused calls stayed behind; the engine still serves, token-exact.
    expected = peft_greedy(lora_base, {"a0": source}, [(lora_prompts[0], "a0")], MAX_TOKENS)
    assert run(llm, [(lora_prompts[0], good)]) == expected
    assert not llm.llm_engine.has_unfinished_requests()

    base_only = LLM(lora_base, kv_cache_memory="64MiB")
    with pytest.raises(ValueError, match="start it with enable_lora"):
        base_only.generate([1, 2, 3], GREEDY, use_tqdm=False, lora_request=good)


def test_adapters_with_speculative_decoding(lora_base, lora_adapters, lora_prompts):
    """Drafts from the base model (a draft model without the adapter) are verified by the
    target with each request's adapter: outputs stay token-exact with peft."""
    names = [None, "a0", "a1"]
    adapters = {name: lora_adapters[name] for name in names[1:]}
    requests = [(prompt, name) for prompt in lora_prompts[:2] for name in names]
    expected = peft_greedy(lora_base, adapters, requests, MAX_TOKENS)
    llm = LLM(
        lora_base, kv_cache_memory="64MiB", enable_lora=True, max_loras=2,
        speculative_config={"method": "draft_model", "model": lora_base,
                            "num_speculative_tokens": 3},
    )
    loras = lora_requests(adapters)
    assert run(llm, [(prompt, loras.get(name)) for prompt, name in requests]) == expected
    spec = llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding_stats
    # Drafts were verified, and the adapters' requests rejected some of the base's.
    assert spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens < spec.num_draft_tokens
