"""The engine core's structured outputs: compile grammars off the loop, mask each step.

- `add_request`: the request's grammar is looked up in the cache (keyed by spec) or
  submitted to a thread pool; the request waits (RequestStatus.WAITING_FOR_GRAMMAR, which
  the scheduler skips) until `poll_grammars` finds it compiled. Others run meanwhile.
- `grammar_bitmask`: after `schedule()`, one packed bitmask row per constrained request
  that samples this step. A step with no constrained request does no work here.
- Tokens are accepted by the scheduler (`Request.structured_output_request`) as it
  appends them; a terminated grammar finishes the request with finish_reason "stop".

The vocabulary is needed to compile: the engine core passes in how to load the tokenizer,
and the first compile (in the pool) loads it, once, so an engine that never sees a
structured request never loads it. Requests are the engine core's (`GrammarRequest`
says what of them this package reads); it imports neither core nor model.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tokenserve.config import EngineConfig
from tokenserve.messages.scheduler_output import SchedulerOutput
from tokenserve.sampling_params import SamplingParams
from tokenserve.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from tokenserve.structured_output.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec

# Compiled grammars kept for reuse (a JSON schema's is ~0.05–1 MB for a 49k vocabulary).
MAX_CACHED_GRAMMARS = 256
COMPILE_WORKERS = 2


@dataclass
class GrammarBitmask:
    """The step's masks: bitmask[i] constrains the sampled row of request_ids[i] at
    positions[i] (0: its first sampled row; j: the row after its first j drafts)."""

    request_ids: list[str]
    bitmask: torch.Tensor  # [len(request_ids), ceil(vocab / 32)] int32
    positions: list[int] | None = None  # None: every row at position 0

    def rows(self) -> list[tuple[str, int]]:
        positions = self.positions or [0] * len(self.request_ids)
        return list(zip(self.request_ids, positions))


class GrammarRequest(Protocol):
    """What the manager reads and sets of an engine-core request (core/request.py)."""

    request_id: str
    sampling_params: SamplingParams
    eos_token_id: int | None
    num_computed_tokens: int
    structured_output_request: StructuredOutputRequest | None

    @property
    def num_tokens(self) -> int: ...

    @property
    def is_finished(self) -> bool: ...

    def wait_for_grammar(self) -> None:
        """Not to be scheduled until `grammar_ready()`."""

    def grammar_ready(self) -> None:
        """Back to waiting for the scheduler, its grammar compiled."""


class StructuredOutputManager:
    def __init__(
        self, config: EngineConfig, load_tokenizer: Callable[[], Any] | None = None
    ) -> None:
        """`load_tokenizer`: returns the model's tokenizer; called once, by the first compile."""
        self.config = config
        self.vocab_size = config.model_config.vocab_size
        self._load_tokenizer = load_tokenizer
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._grammars: OrderedDict[GrammarSpec, Future[CompiledGrammar]] = OrderedDict()
        # Unfinished requests with a grammar, and those of them whose grammar is compiling.
        self._requests: dict[str, GrammarRequest] = {}
        self._compiling: dict[str, GrammarRequest] = {}
        self._bitmask: torch.Tensor | None = None

    # ---- requests in -----------------------------------------------------------------

    def add_request(self, request: GrammarRequest) -> None:
        from tokenserve.structured_output.grammar import GrammarSpec

        params = request.sampling_params.structured_outputs
        assert params is not None
        structured = StructuredOutputRequest(
            self._grammar(GrammarSpec.from_params(params)),
            stop_token_ids=[] if request.eos_token_id is None else [request.eos_token_id],
            enforce_after_token_ids=params.enforce_after_token_ids,
        )
        request.structured_output_request = structured
        self._requests[request.request_id] = request
        if not (structured.poll_grammar() and structured.error is None):
            request.wait_for_grammar()
            self._compiling[request.request_id] = request

    def poll_grammars(self) -> list[GrammarRequest]:
        """Release requests whose grammar is compiled; return those whose compile failed."""
        failed = []
        for request_id, request in list(self._compiling.items()):
            structured = request.structured_output_request
            assert structured is not None
            if request.is_finished:  # aborted while compiling
                del self._compiling[request_id]
            elif structured.poll_grammar():
                del self._compiling[request_id]
                if structured.error is None:
                    request.grammar_ready()
                else:
                    failed.append(request)
        return failed

    def wait_for_grammars(self, timeout: float) -> None:
        """Block until a compiling grammar is ready or `timeout` passes (an idle engine
        waits here instead of spinning while the compile threads need the CPU)."""
        pending = {
            request.structured_output_request.grammar
            for request in self._compiling.values()
            if request.structured_output_request is not None
        }
        if pending:
            concurrent.futures.wait(
                pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )

    @property
    def has_compiling_requests(self) -> bool:
        return bool(self._compiling)

    # ---- one step --------------------------------------------------------------------

    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarBitmask | None:
        """Masks for the constrained requests that sample a token in this step."""
        if not self._requests:
            return None
        for request_id in scheduler_output.finished_req_ids:
            self._requests.pop(request_id, None)
        bitmask = self._bitmask_buffer()
        request_ids: list[str] = []
        positions: list[int] = []
        all_drafts = scheduler_output.scheduled_spec_decode_tokens
        for request_id, request in self._requests.items():
            if request_id not in scheduler_output.num_scheduled_tokens:
                continue
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prompt chunk that samples nothing yet
            structured = request.structured_output_request
            assert structured is not None
            # One mask per sampled position: the first, then after each draft (speculation).
            for position in structured.fill_bitmasks(
                bitmask, len(request_ids), all_drafts.get(request_id, [])
            ):
                request_ids.append(request_id)
                positions.append(position)
        if not request_ids:
            return None
        return GrammarBitmask(request_ids, bitmask[: len(request_ids)], positions)

    # ---- helpers ---------------------------------------------------------------------

    def _grammar(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        future = self._grammars.get(spec)
        if future is not None:
            self._grammars.move_to_end(spec)
            return future
        if self._executor is None:
            self._executor = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="grammar")
        future = self._executor.submit(self._compile, spec)
        self._grammars[spec] = future
        while len(self._grammars) > MAX_CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return future

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._new_compiler()
        return self._compiler.compile(spec)

    def _new_compiler(self) -> GrammarCompiler:
        from tokenserve.structured_output.grammar import GrammarCompiler

        if self._load_tokenizer is None:
            raise RuntimeError("Structured outputs need the tokenizer: no load_tokenizer given.")
        tokenizer = self._load_tokenizer()
        return GrammarCompiler(
            tokenizer, self.vocab_size, max_threads=max(1, (os.cpu_count() or 2) // 2)
        )

    def _bitmask_buffer(self) -> torch.Tensor:
        if self._bitmask is None:
            rows = self.config.scheduler_config.max_num_seqs
            if self.config.speculative_config is not None:
                rows *= 1 + self.config.speculative_config.num_speculative_tokens
            self._bitmask = torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        return self._bitmask
