"""Inputs → engine-core Requests: tokenize, validate, refuse what can never run.

Everything a request could get wrong is caught here, at the edge, with a ValueError
that says what and why; nothing invalid reaches the engine core.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

from tokenserve.config import EngineConfig
from tokenserve.core.request import Request
from tokenserve.engine.pooling_requests import (
    check_pooling_params,
    token_type_start,
    truncate_length,
)
from tokenserve.lora.peft_loader import check_adapter
from tokenserve.lora.request import LoRARequest
from tokenserve.messages.multimodal import MultiModalFeature
from tokenserve.pooling_params import PoolingParams
from tokenserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from tokenserve.multimodal.processing import MultiModalProcessor

# A prompt is text, token ids, or a dict with "prompt" or "prompt_token_ids" (and, for a
# vision-language model, "multi_modal_data": {"image": PIL image(s)}).
PromptType = Union[str, Sequence[int], Mapping[str, Any]]


class Processor:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = config.model_config.max_model_len
        self.vocab_size = config.model_config.vocab_size
        self.eos_token_id = _eos_token_id(tokenizer, config.model_config.hf_config)
        self.max_logprobs = config.model_config.max_logprobs
        # Adapters checked so far, by id (an id names one adapter for the engine's life).
        self.lora_requests: dict[int, LoRARequest] = {}
        # A vision-language model's images → placeholders and pixels (multimodal/).
        self.mm_processor: MultiModalProcessor | None = None
        mm_config = config.model_config.multimodal_config
        if mm_config is not None:
            # A vision model's processor brings transformers' image code and torch; text
            # models never import it (docs/STARTUP.md).
            from tokenserve.multimodal.processing import MultiModalProcessor

            self.mm_processor = MultiModalProcessor(config.model_config.model, tokenizer, mm_config)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, Request]:
        """Returns the prompt text (None for token-id prompts) and the engine-core Request."""
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("LoRA adapters serve generate requests only, not pooling ones.")
            return self._process_pooling(
                request_id, prompt, params, arrival_time, priority, cache_salt
            )
        if self.config.model_config.runner == "pooling":
            raise ValueError(
                "This model runs the 'pooling' runner: it serves embeddings, scores and "
                "classes, and does not generate text."
            )
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        self._check_priority_and_salt(priority, cache_salt)
        if lora_request is not None:
            self.check_lora_request(lora_request)
        params = self._process_sampling_params(params)
        text, token_ids = self._tokenize(prompt)
        token_ids, mm_features = self._process_multimodal(prompt, token_ids)
        self._validate_prompt(token_ids)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            cache_salt=cache_salt,
            # Prompt logprobs need every prompt position's logits: nothing may come from the cache.
            skip_prefix_cache=params.prompt_logprobs is not None,
            lora_request=lora_request,
            mm_features=mm_features,
        )
        return text, request

    def _process_multimodal(
        self, prompt: PromptType, token_ids: list[int]
    ) -> tuple[list[int], list[MultiModalFeature] | None]:
        """A vision-language model's prompt: image tokens expanded, one feature per image."""
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, Mapping) else None
        if self.mm_processor is None:
            if mm_data:
                raise ValueError(
                    f"This model ({self.config.model_config.architecture}) takes no images: "
                    "multi_modal_data needs a vision-language model (LLaVA, Idefics3)."
                )
            return token_ids, None
        token_ids, features = self.mm_processor.process(token_ids, mm_data or {})
        return token_ids, features or None

    def _process_pooling(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams,
        arrival_time: float | None,
        priority: int,
        cache_salt: str | None,
    ) -> tuple[str | None, Request]:
        """A pooling request: its params against the model, its prompt truncated (a text's
        first tokens, token ids' last), a text pair's token types; it samples nothing."""
        model_config = self.config.model_config
        if isinstance(prompt, Mapping) and prompt.get("multi_modal_data"):
            raise ValueError("Pooling requests take no images (multi_modal_data).")
        params = check_pooling_params(params, model_config)
        self._check_priority_and_salt(priority, cache_salt)
        keep = truncate_length(params, self.max_model_len)
        text = prompt.get("prompt") if isinstance(prompt, Mapping) else prompt
        if keep is not None and isinstance(text, str) and not (
            isinstance(prompt, Mapping) and "prompt_token_ids" in prompt
        ):
            token_ids = list(self.tokenizer.encode(text, truncation=True, max_length=keep))
            token_ids = self._token_ids(token_ids)
        else:
            text, token_ids = self._tokenize(prompt)
            if keep is not None:
                token_ids = token_ids[-keep:]
        if isinstance(prompt, Mapping) and prompt.get("token_type_ids") is not None:
            params = dataclasses.replace(
                params, token_type_start=token_type_start(prompt["token_type_ids"], len(token_ids))
            )
        if not token_ids:
            raise ValueError("The prompt is empty: it must contain at least one token.")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"The prompt is {len(token_ids)} tokens long, but max_model_len is "
                f"{self.max_model_len}; truncate it (truncate_prompt_tokens) or shorten it."
            )
        pooling_type = model_config.pooler_config.pooling_type if model_config.pooler_config else None
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            # Nothing is sampled: the request ends when its prompt is computed.
            sampling_params=SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY),
            eos_token_id=None,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            cache_salt=cache_salt,
            # Mean and first-token pooling read every prompt position: none from the cache.
            skip_prefix_cache=pooling_type != "LAST",
            pooling_params=params,
        )
        return text, request

    def _check_priority_and_salt(self, priority: int, cache_salt: str | None) -> None:
        if priority != 0 and self.config.scheduler_config.policy != "priority":
            raise ValueError(
                "priority is only honoured with scheduling_policy='priority'; "
                f"this engine uses {self.config.scheduler_config.policy!r}."
            )
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string.")

    def check_lora_request(self, lora_request: LoRARequest) -> None:
        """The adapter fits this engine and its base model (files, rank, targets, shapes)."""
        lora_config = self.config.lora_config
        if lora_config is None:
            raise ValueError("This engine serves no LoRA adapters: start it with enable_lora.")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__}."
            )
        known = self.lora_requests.get(lora_request.lora_int_id)
        if known == lora_request:
            return
        if known is not None:
            raise ValueError(
                f"lora_int_id {lora_request.lora_int_id} already names the adapter "
                f"{known.lora_name!r} ({known.lora_path}); give each adapter its own id."
            )
        check_adapter(lora_request, self.config.model_config.hf_config, lora_config.max_lora_rank)
        self.lora_requests[lora_request.lora_int_id] = lora_request

    def _process_sampling_params(self, params: SamplingParams) -> SamplingParams:
        """Checks that need the vocabulary; returns a copy with bad_words as token ids."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(
                    f"{name} must be at most max_logprobs={self.max_logprobs}, got {value}."
                )
        structured = params.structured_outputs
        for name, token_ids in (
            ("stop_token_ids", params.stop_token_ids or []),
            ("allowed_token_ids", params.allowed_token_ids or []),
            ("logit_bias", list(params.logit_bias or {})),
            (
                "structured_outputs.enforce_after_token_ids",
                (structured.enforce_after_token_ids or []) if structured else [],
            ),
        ):
            for token_id in token_ids:
                if token_id >= self.vocab_size:
                    raise ValueError(
                        f"{name} holds token id {token_id}, out of this model's vocabulary "
                        f"[0, {self.vocab_size})."
                    )
        if structured is not None:
            # Compiled without the vocabulary here (~1 ms); the engine core compiles it for
            # the vocabulary. Imported late: only structured requests need xgrammar.
            from tokenserve.structured_output.grammar import check_structured_outputs

            check_structured_outputs(structured)
        if params.bad_words:
            return dataclasses.replace(params, bad_words_token_ids=self._bad_words_token_ids(params))
        return params

    def _bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word as the token sequences it may appear as: alone and after a space."""
        sequences: list[list[int]] = []
        for word in params.bad_words or []:
            word = word.strip()
            for text in (word, " " + word):
                token_ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if token_ids and token_ids not in sequences:
                    sequences.append(token_ids)
        return sequences

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError("A prompt dict needs a 'prompt' or a 'prompt_token_ids' key.")
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, Sequence):
            return None, self._token_ids(prompt)
        raise ValueError(
            f"A prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}."
        )

    def _token_ids(self, token_ids: Sequence[int]) -> list[int]:
        ids = list(token_ids)
        for token_id in ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise ValueError(f"Token ids must be integers, got {token_id!r}.")
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"Token id {token_id} is out of range for this model's vocabulary "
                    f"[0, {self.vocab_size})."
                )
        return ids

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("The prompt is empty: it must contain at least one token.")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"The prompt is {len(token_ids)} tokens long, but max_model_len is "
                f"{self.max_model_len}: the prompt must be shorter than that, to leave room "
                "for at least one generated token."
            )


def _eos_token_id(tokenizer, hf_config) -> int | None:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos
