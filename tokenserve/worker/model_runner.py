"""The model runner: turns a SchedulerOutput into one flat batch, runs the model, samples.

It keeps a CachedRequestState per running request, updated by the scheduler's diffs,
so that each step only the new tokens and new blocks cross over. Input preparation is
numpy over whole requests; the model sees [num_tokens] ids and positions, no padding.
Logits are computed for sampled rows and, for requests that asked for prompt logprobs,
for every prompt position of their chunk (only those rows).

A decode row with draft tokens (`scheduled_spec_decode_tokens`) computes its last token
followed by its drafts, and is sampled at each of those 1 + k positions by the rejection
sampler (sample/rejection_sampler.py). With speculative decoding on, the proposer
(spec_decode/) runs after sampling and its drafts go back in the output.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenserve.attention.batch_layout import BatchLayout
from tokenserve.attention.selector import get_attention_backend
from tokenserve.config import EngineConfig
from tokenserve.distributed.parallel_state import ModelParallel
from tokenserve.kernels import layer_ops
from tokenserve.kernels.build import select_isa
from tokenserve.kv_transfer.worker_base import KVConnectorWorker
from tokenserve.kv_transfer.worker_factory import create_worker_connector
from tokenserve.lora.manager import LoRAModelManager
from tokenserve.messages.model_runner_output import ModelRunnerOutput
from tokenserve.messages.scheduler_output import SchedulerOutput
from tokenserve.model.layers.quantization.gguf import QuantizedWeight
from tokenserve.model.load_threads import return_free_memory, torch_threads
from tokenserve.model.precision import activation_dtype
from tokenserve.model.registry import get_model, layers_to_pack
from tokenserve.sample.logits_processors import GrammarMask
from tokenserve.sample.logprobs import LogprobsLists, LogprobsTensors, compute_logprobs
from tokenserve.sample.rejection_sampler import RejectionSampler
from tokenserve.sample.sampler import Sampler
from tokenserve.spec_decode.proposer import attention_rows
from tokenserve.spec_decode.selector import build_proposer
from tokenserve.worker.cpu_memory import (
    HeapReserve,
    KVCachePrefault,
    WeightHugePages,
    keep_freed_memory,
)
from tokenserve.worker.encoder_runner import ChunkRows, EncoderRunner
from tokenserve.worker.pooling_runner import PoolingRunner
from tokenserve.worker.product_warm_up import ProductWarmUp
from tokenserve.worker.request_state import CachedRequestState
from tokenserve.worker.sampling_inputs import build_sampling_metadata

if TYPE_CHECKING:
    from tokenserve.structured_output.manager import GrammarBitmask

# Prompt-logprob rows are turned into logits this many at a time, bounding the memory a
# long prompt needs ([rows, vocab] floats).
_PROMPT_LOGITS_CHUNK = 256
# The least heap the idle warm-up faults in for a step's activations (`_step_heap_bytes`):
# what a step also allocates beside its per-token activations (the default model's first
# 512-token step faulted 12-26 MiB in).
STEP_HEAP_MIN_BYTES = 64 << 20


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        device: torch.device | None = None,
        parallel: ModelParallel | None = None,
    ) -> None:
        self.config = config
        self.device = device or torch.device("cpu")
        # This rank's share of the model: its heads and its pipeline stage's layers.
        self.parallel = parallel or ModelParallel()
        self.block_size = config.cache_config.block_size
        model_config = config.model_config
        # The C kernels of this process: the instruction set chosen (or forced) before any loads.
        select_isa(config.kernel_config.cpu_isa)
        self.attention = get_attention_backend(
            self.device,
            activation_dtype(model_config.dtype),
            cascade=not model_config.disable_cascade_attn,
            use_c_kernels=not config.kernel_config.disable_c_kernels,
            weights_dtype=model_config.torch_dtype,
            split_decode=not config.kernel_config.batch_invariant,
        )
        kernels = None if config.kernel_config.disable_c_kernels else layer_ops.load()
        self.sampler = Sampler(kernels.argmax_rows if kernels is not None else None)
        self.rejection_sampler = RejectionSampler()
        self.proposer = build_proposer(config, self.attention, self.device)
        self.requests: dict[str, CachedRequestState] = {}
        # Per-request generators outlive preemption: a resumed request keeps drawing
        # from where it stopped.
        self.generators: dict[str, torch.Generator] = {}
        # Prompt logprobs gathered so far, across chunks (and preemptions); None once sent.
        self.prompt_logprobs: dict[str, LogprobsLists | None] = {}
        self.model: torch.nn.Module | None = None
        # One per layer, in the attention backend's layout.
        self.kv_caches: list[torch.Tensor] = []
        self.kv_prefault: KVCachePrefault | None = None  # a CPU cache's, once allocated
        self.layers_to_pack: list[torch.nn.Module] = []  # left by the load, for warm_up
        self.product_warm_up: ProductWarmUp | None = None  # made on first use
        self.heap_reserve: HeapReserve | None = None  # on CPU, made with it
        self.weight_pages: WeightHugePages | None = None  # made once the heap is reserved
        # --runner pooling: prompts pooled instead of tokens sampled (pooling_runner.py).
        self.pooling = PoolingRunner(config) if model_config.runner == "pooling" else None
        # With enable_lora: the adapters' slots in the wrapped layers (lora/manager.py).
        self.lora_manager: LoRAModelManager | None = None
        # A vision-language model: image encoders and their outputs (worker/encoder_runner.py).
        self.encoder_runner: EncoderRunner | None = None
        if model_config.multimodal_config is not None:
            self.encoder_runner = EncoderRunner(self.device)
        # With --kv-transfer-config: loads before each step's forward, saves after it.
        self.kv_connector: KVConnectorWorker | None = None
        if config.kv_transfer_config is not None:
            self.kv_connector = create_worker_connector(config.kv_transfer_config)

    def load_model(self) -> None:
        # oneDNN's packing waits for idle time (warm_up) or a layer's first product that
        # reads it: a start's first requests multiply by other forms, or pack as they go.
        self.model = get_model(
            self.config.model_config, self.attention, self.config.kernel_config, self.device,
            self.parallel, pack_weights=False,
        )
        # Popped from the end: in the model's order, the largest piece (the head) last.
        self.layers_to_pack = layers_to_pack(self.model)[::-1]
        if self.config.lora_config is not None:
            model_config = self.config.model_config
            self.lora_manager = LoRAModelManager(
                self.model, self.config.lora_config, model_config.hf_config,
                activation_dtype(model_config.dtype), self.device,
            )
        if self.proposer is not None:
            self.proposer.load_model()

    def initialize_kv_cache(self) -> None:
        model_config = self.config.model_config
        if model_config.is_encoder_only:
            return  # bidirectional encoders keep no KV cache
        self.kv_caches = self.attention.allocate_kv_cache(
            num_layers=len(self.parallel.pp.layers(model_config.num_layers)),
            num_blocks=self.config.cache_config.num_blocks,
            block_size=self.block_size,
            num_kv_heads=self.config.parallel_config.kv_heads_per_rank(model_config.num_kv_heads),
            head_size=model_config.head_dim,
            dtype=self.config.cache_config.torch_dtype,
            device=self.device,
        )
        if self.proposer is not None:
            self.proposer.initialize_kv_cache()
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches)
        if self.device.type == "cpu" and self.config.cache_config.prefault_when_idle:
            draft_caches = self.proposer.kv_caches if self.proposer is not None else []
            self.kv_prefault = KVCachePrefault(
                [*self.kv_caches, *draft_caches], self.attention.kv_cache_block_dim(),
                self.config.cache_config.num_blocks,
            )

    def prefault_kv_cache(self, max_seconds: float) -> bool:
        """Fault in more of the KV caches' pages ahead of their first use for about
        max_seconds (worker/cpu_memory.py); whether any are left. For the engine core's idle
        time."""
        return self.kv_prefault is not None and self.kv_prefault.step(max_seconds)

    def pack_weights(self) -> None:
        """Pack every weight the load left unpacked (warm_up does it a layer per call)."""
        while self._pack_one_weight():
            pass

    def _pack_one_weight(self) -> bool:
        """Pack one more layer's weight the load left unpacked; whether there was one."""
        while self.layers_to_pack:
            layer = self.layers_to_pack.pop()
            if layer.packing_pending:  # else a product packed it already
                layer.quant_method.pack_weight(layer)
                return True
        return False

    def warm_up(self) -> bool:
        """One more piece of what the first steps of each size would otherwise pay for:
        oneDNN's packing of the weights no product has packed yet, a layer per call; the
        oneDNN primitives the model's bf16 products will run at, one product per call, for
        every row bucket up to the step budget's (worker/product_warm_up.py); then, on CPU,
        the heap memory a step of the budget's tokens allocates, a piece per call, and the
        model's weights moved onto huge pages, one per call (worker/cpu_memory.py;
        --no-weight-huge-pages: not). Whether any are left. For the engine core's idle time,
        on the thread that runs the steps."""
        if self.layers_to_pack:
            # On one thread: the API process, answering the first requests, keeps a core.
            with torch_threads(1):
                packed = self._pack_one_weight()
            if packed:
                if not self.layers_to_pack:
                    # The dense weights the packing freed, back to the system before the
                    # heap reserve below takes what a step's activations need.
                    return_free_memory()
                return True
        budget = self.config.scheduler_config.max_num_batched_tokens
        if self.product_warm_up is None:
            self.product_warm_up = ProductWarmUp(self.model, budget)
            if self.device.type == "cpu" and keep_freed_memory():
                self.heap_reserve = HeapReserve(self._step_heap_bytes(budget))
        if self.product_warm_up.step():
            return True
        heap = self.heap_reserve
        if heap is not None and heap.done < heap.pieces:
            heap.step()
            return True  # the weights' pages, if nothing else, are left
        if self.weight_pages is None:
            self.weight_pages = WeightHugePages(
                weight_tensors(self.model)
                if self.device.type == "cpu" and self.config.kernel_config.weight_huge_pages
                else [])
        return self.weight_pages.step()

    def _step_heap_bytes(self, tokens: int) -> int:
        """The heap a step of `tokens` tokens takes, about: twice a decoder layer's
        activations per token (the hidden state in and out, q, k and v, the MLP's gate, up
        and their product) in the activation dtype, and at least STEP_HEAP_MIN_BYTES. The
        default model's first steps of 512 and 2,048 tokens (bfloat16) faulted 12-26 and
        40-56 MiB in without it, fewer than 600 pages with it (docs/PERFORMANCE_CPU.md, "The
        heap of the first full step")."""
        model_config = self.config.model_config
        text = model_config.text_config
        hidden = text.hidden_size
        heads = text.num_attention_heads * model_config.head_dim
        kv = model_config.num_kv_heads * model_config.head_dim
        intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
        widths = 2 * hidden + heads + 2 * kv + 3 * intermediate
        element_size = activation_dtype(model_config.dtype).itemsize
        return max(STEP_HEAP_MIN_BYTES, 2 * tokens * widths * element_size)

    def shutdown(self) -> None:
        """Stop a KV connector's listeners and transfers."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        """Run one step. `grammar_bitmask` constrains the sampled rows of structured-output
        requests (the engine core's StructuredOutputManager fills it)."""
        self._update_states(scheduler_output)
        if self.kv_connector is None:
            return self._execute(scheduler_output, grammar_bitmask)
        # Per step: the step's external KV is in its blocks before the forward reads it,
        # and the blocks it completes are saved before anything can reuse them.
        self.kv_connector.start_load_kv(scheduler_output.kv_connector_metadata)
        output = self._execute(scheduler_output, grammar_bitmask)
        self.kv_connector.save_kv(scheduler_output.kv_connector_metadata)
        self.kv_connector.wait_for_save()
        output.kv_connector_output = self.kv_connector.get_output(scheduler_output.finished_req_ids)
        return output

    def _execute(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None
    ) -> ModelRunnerOutput:
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        assert self.model is not None, "load_model() must run before execute_model()"

        request_ids = list(scheduler_output.num_scheduled_tokens)
        token_ids: list[np.ndarray] = []
        layout = BatchLayout(self.block_size)
        sampled_ids: list[str] = []
        logits_indices: list[int] = []
        # request id → (first prompt position of this chunk, flat index of it, count).
        prompt_rows: dict[str, tuple[int, int, int]] = {}
        all_drafts = scheduler_output.scheduled_spec_decode_tokens
        mm_chunks: list[ChunkRows] = []
        for request_id in request_ids:
            state = self.requests[request_id]
            num_tokens = scheduler_output.num_scheduled_tokens[request_id]
            drafts = all_drafts.get(request_id, [])
            start = state.num_computed_tokens
            end = start + num_tokens
            # The request's own tokens to compute, then its drafts (positions continue).
            known_end = end - len(drafts)
            if drafts:
                assert known_end == state.num_tokens, "drafts follow a request's last token"
                token_ids.append(state.token_ids[start:known_end])
                token_ids.append(np.asarray(drafts, dtype=np.int64))
            else:
                token_ids.append(state.token_ids[start:end])
            if request_id in self.prompt_logprobs:
                first, count = self._prompt_logprob_positions(state, start, known_end)
                if count > 0:
                    flat_first = layout.query_start_loc[-1] + first - start
                    prompt_rows[request_id] = (first, flat_first, count)
            if self.encoder_runner is not None:
                mm_chunks.append(ChunkRows(request_id, layout.query_start_loc[-1], start, end))
            # A verifying row's tokens attend as decode rows, one each (attention_rows).
            layout.add(start, end, state.block_ids, attention_rows(start, end, split=bool(drafts)))
            if known_end >= state.num_tokens:
                # The request's last known token is computed: its logits give the next one,
                # and each draft's logits the token after that draft.
                sampled_ids.append(request_id)
                last = layout.query_start_loc[-1] - 1
                logits_indices.extend(range(last - len(drafts), last + 1))

        if self.lora_manager is not None:
            # Each request's tokens → its adapter's slot (batch order, contiguous).
            self.lora_manager.set_active_loras(
                [self.requests[r].lora_request for r in request_ids],
                [scheduler_output.num_scheduled_tokens[r] for r in request_ids],
            )
        metadata = self.attention.build_metadata(layout.common_metadata(self.device))
        model_inputs = (
            torch.from_numpy(np.concatenate(token_ids)).to(self.device),
            layout.positions_tensor(self.device),
            self.kv_caches,
            metadata,
        )
        if self.pooling is not None:
            return self.pooling.execute(
                self.model, request_ids, self.requests, layout.query_start_loc, *model_inputs
            )
        inputs_embeds = None
        if self.encoder_runner is not None:
            self.encoder_runner.execute_encoders(self.model, scheduler_output)
            inputs_embeds = self.encoder_runner.inputs_embeds(
                self.model, model_inputs[0], mm_chunks
            )
        if inputs_embeds is None:
            hidden_states = self.model(*model_inputs)
        else:
            hidden_states = self.model(*model_inputs, inputs_embeds=inputs_embeds)
        if hidden_states is None:
            # A pipeline stage before the last: that one samples, and the scheduler sends the
            # tokens on with the steps that compute them (CachedRequestData.new_token_ids).
            return ModelRunnerOutput()
        for request_id, rows in prompt_rows.items():
            self._gather_prompt_logprobs(self.requests[request_id], hidden_states, *rows)
        output = ModelRunnerOutput()
        if sampled_ids:
            output = self._sample(
                sampled_ids, hidden_states[logits_indices], grammar_bitmask, all_drafts
            )
        if self.proposer is not None:
            output.draft_token_ids = self.proposer.propose(
                scheduler_output, self.requests, sampled_ids
            )
        return output

    def _sample(
        self,
        sampled_ids: list[str],
        hidden_states: torch.Tensor,
        grammar_bitmask: GrammarBitmask | None,
        all_drafts: dict[str, list[int]],
    ) -> ModelRunnerOutput:
        """Sample each request's rows: one, or 1 + k for a request verifying k drafts."""
        assert self.model is not None
        logits = self.model.compute_logits(hidden_states)
        states = [self.requests[request_id] for request_id in sampled_ids]
        # One row per sampled position; a draft position's row sees the request as if the
        # drafts before it had been accepted (they must be, for its token to count).
        row_states: list[CachedRequestState] = []
        first_row: dict[str, int] = {}
        for state in states:
            first_row[state.request_id] = len(row_states)
            drafts = all_drafts.get(state.request_id, [])
            row_states.append(state)
            row_states.extend(_with_drafts(state, drafts[:i]) for i in range(1, len(drafts) + 1))
        metadata = build_sampling_metadata(
            row_states, self.generators, self.config.model_config.vocab_size, self.device
        )
        if grammar_bitmask is not None:
            metadata.processors.grammar = GrammarMask(
                [
                    first_row[request_id] + position
                    for request_id, position in grammar_bitmask.rows()
                ],
                grammar_bitmask.bitmask,
            )
        if all_drafts:
            drafts = [all_drafts.get(state.request_id, []) for state in states]
            draft_probs = None
            if self.proposer is not None:
                draft_probs = [
                    self.proposer.draft_probs(state.request_id, d) if d else None
                    for state, d in zip(states, drafts)
                ]
            verified = self.rejection_sampler(logits, metadata, drafts, draft_probs)
            per_request, row_logprobs = verified.new_token_ids, verified.logprobs
        else:
            sampler_output = self.sampler(logits, metadata)
            per_request = [[token] for token in sampler_output.token_ids.tolist()]
            row_logprobs = sampler_output.logprobs

        # Per sampled request its new tokens: one, or the accepted drafts and one more.
        output = ModelRunnerOutput(req_ids=sampled_ids)
        logprob_rows: list[int] = []
        logprob_counts: list[tuple[str, int, int]] = []  # request id, k, positions
        for state, new_tokens in zip(states, per_request):
            row = first_row[state.request_id]
            prompt_logprobs = self.prompt_logprobs.get(state.request_id)
            if prompt_logprobs is not None and state.num_output_tokens == 0:
                output.prompt_logprobs[state.request_id] = prompt_logprobs
                self.prompt_logprobs[state.request_id] = None
            for token in new_tokens:
                state.append_token(token)
            output.sampled_token_ids.append(new_tokens)
            if state.sampling_params.logprobs is not None:
                # Row row + i sampled new token i: its logprobs are that token's.
                logprob_rows.extend(range(row, row + len(new_tokens)))
                logprob_counts.append(
                    (state.request_id, state.sampling_params.logprobs, len(new_tokens))
                )
        if row_logprobs is not None and logprob_rows:
            wanted = row_logprobs
            if len(logprob_rows) < len(row_states):
                index = torch.tensor(logprob_rows, device=self.device)
                wanted = LogprobsTensors(
                    wanted.token_ids[index], wanted.logprobs[index], wanted.ranks[index]
                )
            per_row = wanted.tolists([k for _, k, n in logprob_counts for _ in range(n)])
            position = 0
            for request_id, _, count in logprob_counts:
                lists = per_row[position]
                for extra in per_row[position + 1 : position + count]:
                    lists.extend(extra)
                output.logprobs[request_id] = lists
                position += count
        return output

    def _prompt_logprob_positions(
        self, state: CachedRequestState, start: int, end: int
    ) -> tuple[int, int]:
        """Positions of this chunk whose logits score the next prompt token, not yet done.

        Position j's logits give the logprob of prompt token j + 1, for j < prompt length - 1.
        """
        done = self.prompt_logprobs[state.request_id]
        if done is None:
            return start, 0
        first = max(start, len(done))
        return first, max(0, min(end, state.num_prompt_tokens - 1) - first)

    def _gather_prompt_logprobs(
        self,
        state: CachedRequestState,
        hidden_states: torch.Tensor,
        first_position: int,
        first_index: int,
        count: int,
    ) -> None:
        assert self.model is not None
        num_logprobs = state.sampling_params.prompt_logprobs or 0
        num_logprobs = min(num_logprobs, self.config.model_config.vocab_size)
        done = self.prompt_logprobs[state.request_id]
        assert done is not None
        for offset in range(0, count, _PROMPT_LOGITS_CHUNK):
            rows = min(_PROMPT_LOGITS_CHUNK, count - offset)
            index = first_index + offset
            logits = self.model.compute_logits(hidden_states[index : index + rows]).float()
            position = first_position + offset
            targets = torch.from_numpy(state.token_ids[position + 1 : position + 1 + rows].copy())
            done.extend(
                compute_logprobs(
                    logits.log_softmax(dim=-1), targets.to(self.device), num_logprobs
                ).tolist()
            )

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        if self.pooling is not None:
            self.pooling.update_states(scheduler_output)
        if self.encoder_runner is not None:
            self.encoder_runner.update_states(scheduler_output)
        for request_id in scheduler_output.finished_req_ids:
            self.requests.pop(request_id, None)
            self.generators.pop(request_id, None)
            self.prompt_logprobs.pop(request_id, None)
        for request_id in scheduler_output.preempted_req_ids:
            self.requests.pop(request_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            self.requests[new.request_id] = CachedRequestState.create(
                request_id=new.request_id,
                token_ids=new.token_ids,
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_id=new.eos_token_id,
                lora_request=new.lora_request,
            )
            if params.seed is not None and new.request_id not in self.generators:
                self.generators[new.request_id] = torch.Generator(self.device).manual_seed(
                    params.seed
                )
            if params.prompt_logprobs is not None and new.request_id not in self.prompt_logprobs:
                self.prompt_logprobs[new.request_id] = LogprobsLists([], [], [])
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.new_token_ids:
                # A stage that did not sample them: the tokens end at the step's last position.
                end = cached.num_computed_tokens + scheduler_output.num_scheduled_tokens[
                    cached.request_id
                ]
                first = end - len(cached.new_token_ids)
                for position, token in enumerate(cached.new_token_ids, first):
                    if position == state.num_tokens:
                        state.append_token(token)


def _with_drafts(state: CachedRequestState, drafts: list[int]) -> CachedRequestState:
    """A view of `state` with `drafts` appended as output tokens, for the sampling inputs of
    a draft position (penalties, min_tokens, bad words see the tokens before it). It shares
    the request's cached tensors, which depend only on its params and prompt."""
    buffer = np.concatenate([state.token_ids, np.asarray(drafts, dtype=np.int64)])
    return replace(state, token_buffer=buffer, num_tokens=len(buffer))


def weight_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What the model's decode steps read, step after step: its parameters and buffers, and
    per linear layer what its products of few rows multiply by: a GGUF model's blocks (with
    the 8-bit kernel's copy of them, made here where products will take it:
    QuantizedWeight.resident_tensors), else oneDNN's packed weight. (A GGUF layer's packed
    weight serves steps of many rows, bound by arithmetic rather than by the TLB.)"""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        blocks = getattr(module, "blocks", None)
        packed = getattr(module, "packed_weight", None)
        if isinstance(blocks, QuantizedWeight):
            tensors += blocks.resident_tensors()
        elif isinstance(packed, torch.Tensor):
            tensors.append(packed)
    return tensors
