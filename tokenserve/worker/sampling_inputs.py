"""One step's SamplingMetadata, built from the sampled requests' states.

The work here is per request, never per token or per vocabulary entry: features a row
does not use cost it nothing, and a step where no request uses a feature skips it.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenserve.sample.logits_processors import (
    AllowedTokens,
    BannedTokens,
    LogitBias,
    LogitsProcessorInputs,
    Penalties,
)
from tokenserve.sample.sampler import SamplingMetadata
from tokenserve.worker.request_state import CachedRequestState


def build_sampling_metadata(
    states: list[CachedRequestState],
    generators: dict[str, torch.Generator],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    params = [state.sampling_params for state in states]
    greedy = [p.is_greedy for p in params]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    min_p = [0.0 if g else p.min_p for g, p in zip(greedy, params)]
    num_logprobs = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=torch.tensor(
            [1.0 if g else p.temperature for g, p in zip(greedy, params)], device=device
        ),
        greedy=torch.tensor(greedy, device=device),
        all_greedy=all(greedy),
        top_k=None if all(k == vocab_size for k in top_k) else torch.tensor(top_k, device=device),
        top_p=None if all(p == 1.0 for p in top_p) else torch.tensor(top_p, device=device),
        min_p=None if not any(min_p) else torch.tensor(min_p, device=device),
        generators={
            row: generators[state.request_id]
            for row, state in enumerate(states)
            if state.request_id in generators and not greedy[row]
        },
        processors=LogitsProcessorInputs(
            allowed=_allowed_tokens(states, vocab_size, device),
            banned=_banned_tokens(states, device),
            logit_bias=_logit_bias(states, device),
            penalties=_penalties(states, vocab_size, device),
        ),
        max_num_logprobs=max(num_logprobs) if num_logprobs else None,
    )


def _allowed_tokens(
    states: list[CachedRequestState], vocab_size: int, device: torch.device
) -> AllowedTokens | None:
    rows = [row for row, s in enumerate(states) if s.sampling_params.allowed_token_ids is not None]
    if not rows:
        return None
    masks = []
    for row in rows:
        cached = states[row].cached_tensors
        if "allowed_mask" not in cached:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            mask[states[row].sampling_params.allowed_token_ids] = True
            cached["allowed_mask"] = mask
        masks.append(cached["allowed_mask"])
    return AllowedTokens(torch.tensor(rows, device=device), torch.stack(masks))


def _banned_tokens(states: list[CachedRequestState], device: torch.device) -> BannedTokens | None:
    """Stop tokens while a row is below min_tokens, and the last token of any bad word
    whose other tokens end the row's output."""
    rows: list[int] = []
    token_ids: list[int] = []
    for row, state in enumerate(states):
        params = state.sampling_params
        banned: list[int] = []
        if state.num_output_tokens < params.min_tokens:
            banned.extend(params.stop_token_ids or ())
            # As in vLLM, EOS is held back even with ignore_eos.
            if state.eos_token_id is not None:
                banned.append(state.eos_token_id)
        if params.bad_words_token_ids:
            banned.extend(_bad_word_bans(params.bad_words_token_ids, state.output_token_ids))
        rows.extend([row] * len(banned))
        token_ids.extend(banned)
    if not rows:
        return None
    return BannedTokens(torch.tensor(rows, device=device), torch.tensor(token_ids, device=device))


def _bad_word_bans(bad_words: list[list[int]], output_token_ids: np.ndarray) -> list[int]:
    banned = []
    num_output = len(output_token_ids)
    for word in bad_words:
        prefix_length = len(word) - 1
        if prefix_length > num_output:
            continue
        if (
            prefix_length == 0
            or output_token_ids[num_output - prefix_length :].tolist() == word[:-1]
        ):
            banned.append(word[-1])
    return banned


def _logit_bias(states: list[CachedRequestState], device: torch.device) -> LogitBias | None:
    rows, token_ids, values = [], [], []
    for row, state in enumerate(states):
        bias = state.sampling_params.logit_bias
        if not bias:
            continue
        cached = state.cached_tensors
        if "bias_ids" not in cached:
            cached["bias_ids"] = torch.tensor(list(bias), dtype=torch.int64, device=device)
            cached["bias_values"] = torch.tensor(
                list(bias.values()), dtype=torch.float32, device=device
            )
        rows.append(torch.full((len(bias),), row, dtype=torch.int64, device=device))
        token_ids.append(cached["bias_ids"])
        values.append(cached["bias_values"])
    if not rows:
        return None
    return LogitBias(torch.cat(rows), torch.cat(token_ids), torch.cat(values))


def _penalties(
    states: list[CachedRequestState], vocab_size: int, device: torch.device
) -> Penalties | None:
    rows = [row for row, s in enumerate(states) if s.sampling_params.uses_penalties]
    if not rows:
        return None
    max_output = max(states[row].num_output_tokens for row in rows)
    padded = np.full((len(rows), max(max_output, 1)), vocab_size, dtype=np.int64)
    prompt_masks = []
    for index, row in enumerate(rows):
        state = states[row]
        padded[index, : state.num_output_tokens] = state.output_token_ids
        cached = state.cached_tensors
        if "prompt_mask" not in cached:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            mask[torch.from_numpy(state.prompt_token_ids.copy()).to(device)] = True
            cached["prompt_mask"] = mask
        prompt_masks.append(cached["prompt_mask"])
    params = [states[row].sampling_params for row in rows]
    return Penalties(
        rows=torch.tensor(rows, device=device),
        output_token_ids=torch.from_numpy(padded).to(device),
        prompt_mask=torch.stack(prompt_masks),
        presence=torch.tensor([p.presence_penalty for p in params], device=device),
        frequency=torch.tensor([p.frequency_penalty for p in params], device=device),
        repetition=torch.tensor([p.repetition_penalty for p in params], device=device),
    )
