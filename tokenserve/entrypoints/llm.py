"""The offline API: `LLM(model).generate(prompts, sampling_params)` and `.chat(messages)`;
with `runner="pooling"`, `.embed(prompts)`, `.classify(prompts)`, `.score(text_1, text_2)`
and `.encode(prompts)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, cast

from tqdm.auto import tqdm

from tokenserve.core.gc_heap import heap_frozen_during_run
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.engine.llm_engine import LLMEngine
from tokenserve.engine.processor import PromptType
from tokenserve.entrypoints.chat_utils import ChatContentConfig, render_chat_prompt
from tokenserve.entrypoints.scoring import cosine_similarity, cross_encoder_prompt, score_pairs
from tokenserve.lora.request import LoRARequest
from tokenserve.multimodal.media import MediaConnector
from tokenserve.multimodal.media_security import MediaConnectorConfig
from tokenserve.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenserve.pooling_params import PoolingParams
from tokenserve.sampling_params import RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """An engine for offline batched generation.

    `model` is a Hugging Face directory or a .gguf file; None serves the default model
    (SmolLM2-135M-Instruct). Other keyword arguments are engine arguments
    (`EngineArgs`): max_model_len, max_num_batched_tokens, max_num_seqs, block_size,
    kv_cache_memory, num_kv_blocks, enable_prefix_caching, enable_chunked_prefill,
    scheduling_policy, prefill_order, dtype, seed, ... The media arguments of
    `MediaConnectorConfig` (allowed_media_domains, allowed_local_media_path,
    allowed_media_networks, media_fetch_timeout, max_media_bytes, max_image_pixels) say
    what image URLs `chat` may fetch (docs/MEDIA_SECURITY.md).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        media_args = {
            name: engine_args.pop(name)
            for name in MediaConnectorConfig.field_names() & set(engine_args)
        }
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise ValueError(f"Unknown engine argument(s): {', '.join(sorted(unknown))}.")
        self.media_connector = MediaConnector(MediaConnectorConfig(**media_args))
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        # The model's image placeholder for "string" chat templates (the VLM's processor's).
        mm_processor = self.llm_engine.processor.mm_processor
        self.image_placeholder = (
            mm_processor.image_token if mm_processor else ChatContentConfig().image_placeholder
        )
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        cache_salt: str | Sequence[str | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.
        `lora_request`: one adapter for every prompt, or one (or None) per prompt."""
        prompt_list = _as_prompt_list(prompts)
        count = len(prompt_list)
        params_list = _broadcast(sampling_params or SamplingParams(), count, "sampling_params")
        priorities = _broadcast(priority if priority is not None else 0, count, "priority")
        salts = _broadcast(cache_salt, count, "cache_salt")
        loras = _broadcast(lora_request, count, "lora_request")

        request_ids: list[str] = []
        try:
            for prompt, params, prio, salt, lora in zip(
                prompt_list, params_list, priorities, salts, loras
            ):
                # Offline, only the final output of each request is of use.
                params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                request_id = str(next(self._request_counter))
                self.llm_engine.add_request(
                    request_id, prompt, params, priority=prio, cache_salt=salt, lora_request=lora
                )
                request_ids.append(request_id)
        except Exception:
            # One bad prompt refuses the whole call; nothing of it stays in the engine.
            self.llm_engine.abort_request(request_ids)
            raise
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template_content_format: str = "auto",
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate (with
        `lora_request`: one adapter, or one per conversation). Content parts may carry
        images: `image_url` (fetched by the media connector) or `image_pil` (a PIL image)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        content = ChatContentConfig(chat_template_content_format, self.image_placeholder)
        prompts = []
        for conversation in conversations:
            prompt = render_chat_prompt(
                tokenizer,
                cast(ChatMessages, conversation),
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                content=content,
            )
            # The template wrote the special tokens (BOS included) itself.
            token_ids = tokenizer.encode(prompt.text, add_special_tokens=False)
            engine_prompt: dict[str, Any] = {"prompt": prompt.text, "prompt_token_ids": token_ids}
            if prompt.images:
                images = self.media_connector.fetch_images(prompt.images)
                engine_prompt["multi_modal_data"] = {"image": images}
            prompts.append(engine_prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt (a pooling model, runner="pooling"); outputs in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(
            pooling_params or PoolingParams(), len(prompt_list), "pooling_params"
        )
        request_ids: list[str] = []
        try:
            for prompt, params in zip(prompt_list, params_list):
                if not isinstance(params, PoolingParams):
                    raise ValueError(  # noqa: TRY004 - bad input is a ValueError here
                        f"pooling_params must be PoolingParams, got {type(params).__name__}."
                    )
                if pooling_task is not None:
                    params = dataclasses.replace(params, task=pooling_task)
                request_id = str(next(self._request_counter))
                self.llm_engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        return cast(list[PoolingRequestOutput], self._run_engine(request_ids, use_tqdm))

    def embed(
        self, prompts, pooling_params=None, use_tqdm: bool = True
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`)."""
        outputs = self.encode(prompts, pooling_params, use_tqdm, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def classify(
        self, prompts, pooling_params=None, use_tqdm: bool = True
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (`outputs.probs`)."""
        outputs = self.encode(prompts, pooling_params, use_tqdm, pooling_task="classify")
        return [ClassificationRequestOutput.from_base(output) for output in outputs]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """One score per pair (one text_1 against each text_2, or pairwise): a cross-encoder's
        relevance, or an embedding model's cosine similarity."""
        pairs = score_pairs(text_1, text_2)
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        model_config = self.llm_engine.config.model_config
        if "score" in model_config.pooling_tasks:
            prompts = [
                cross_encoder_prompt(self.get_tokenizer(), a, b, params.truncate_prompt_tokens)
                for a, b in pairs
            ]
            outputs = self.encode(prompts, params, use_tqdm, pooling_task="score")
            return [ScoringRequestOutput.from_base(output) for output in outputs]
        texts = [text for pair in pairs for text in pair]
        embeddings = self.embed(texts, params, use_tqdm)
        results = []
        for first, second in zip(embeddings[::2], embeddings[1::2]):
            score = cosine_similarity(first.outputs.embedding, second.outputs.embedding)
            results.append(
                ScoringRequestOutput(
                    request_id=f"{first.request_id}_{second.request_id}",
                    outputs=ScoringOutput(score),
                    prompt_token_ids=first.prompt_token_ids + second.prompt_token_ids,
                )
            )
        return results

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[Any]:
        pending = set(request_ids)
        finished: dict[str, Any] = {}
        progress = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            # The model and everything else built before stay out of the collections a
            # long run makes (core/gc_heap.py); handed back when it ends.
            with heap_frozen_during_run():
                while pending:
                    for output in self.llm_engine.step():
                        if output.request_id in pending:
                            pending.discard(output.request_id)
                            finished[output.request_id] = output
                            progress.update(1)
        except BaseException:
            self.llm_engine.abort_request(list(pending))
            raise
        finally:
            progress.close()
        return [finished[request_id] for request_id in request_ids]


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # One prompt given as token ids.
    if not prompts:
        raise ValueError("No prompts given.")
    return prompts


def _broadcast(value, count: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts.")
        return list(value)
    return [value] * count
