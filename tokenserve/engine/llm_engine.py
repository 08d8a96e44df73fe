"""The in-process engine: processor → engine core → output processor.

The offline `LLM` class drives it step by step. Tokenizing and detokenizing happen
here, around the engine core, never inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenserve.config import EngineConfig
from tokenserve.core.engine_core import EngineCore
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.engine.output_processor import OutputProcessor
from tokenserve.engine.parallel_sampling import fan_out
from tokenserve.engine.processor import Processor, PromptType
from tokenserve.lora.request import LoRARequest
from tokenserve.messages.engine_core import SchedulerStats
from tokenserve.model.loader import load_tokenizer
from tokenserve.outputs import PoolingRequestOutput, RequestOutput
from tokenserve.pooling_params import PoolingParams
from tokenserve.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel_config.data_parallel_size > 1:
            # Data parallelism runs engine cores in their own processes (engine/dp_client.py).
            raise ValueError(
                "data_parallel_size > 1 is served by `tokenserve serve` (AsyncLLM) only; the "
                "offline LLM runs one engine core in this process."
            )
        self.config = config
        self.tokenizer = load_tokenizer(config.model_config.files, config.model_config.tokenizer)
        self.processor = Processor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(config, load_tokenizer=lambda: self.tokenizer)
        # No idle time to pack in, as a server has: ready here means packed.
        self.engine_core.pack_weights()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        prompt_text, request = self.processor.process(
            request_id, prompt, params, arrival_time, priority, cache_salt, lora_request
        )
        self.output_processor.add_request(
            request_id,
            prompt_text,
            request.prompt_token_ids,
            request.pooling_params or request.sampling_params,
            request.arrival_time,
        )
        # n > 1: the n children go in together, so they are admitted in the same step and
        # share the prompt's KV blocks through the prefix cache.
        for core_request in fan_out(request):
            self.engine_core.add_request(core_request)

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        processed = self.output_processor.process_outputs(self.engine_core.step())
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run a worker method (or `method(worker, ...)`) on every worker: one result each."""
        return self.engine_core.collective_rpc(method, args, kwargs)
