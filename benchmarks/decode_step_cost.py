"""What a decode step of B rows costs, by B: the steps of W1, W2 and W5 once their prompts are
in, where each running request adds one row.

For each batch size B, B requests of `--input-len` random tokens (greedy, EOS ignored) are
added at once and stepped until every one has its first token; then `--steps` decode steps
of all B rows are timed and their median printed, with the fastest. No request finishes
before the timed steps are over (their max_tokens leave room for the prompts' chunked
steps, in which the first ones already decode); the rest of each is then aborted. `--cpu-time` times the calling thread's CPU (`time.thread_time`) instead of the
wall clock: run it with `OMP_NUM_THREADS=1` and the figure is what a step costs, whatever
else the machine runs.

`--other-csrc DIR` sets another tree's C kernels (its tokenserve/kernels/csrc) beside this
one's in the same engine: the fused decode layer's library (kernels/csrc/decode_layer.c,
which holds every operator of a decode step but the logits) alternates between the two
builds step by step, and each build's median is printed with their ratio. This machine's
speed drifts by more than a kernel change moves a step from one run to the next; steps
taking turns in one process see the same drift. Both trees need `ts_decode_layers`, the
one-call entry point (against a tree from before it, run this script from a commit before
it too).

`--other-bf16-quantized-max-rows N` takes turns the same way between a bfloat16 model's
row limit for its GGUF blocks' bf16 kernel (AMX or vdpbf16ps; `--bf16-quantized-max-rows`)
as the engine set it and N: steps of more rows than N then run operator by operator, their
products on oneDNN's bf16 GEMM.

`--warm-up` runs the engine core's idle-time warm-up to its end before the first batch, as
a server does before its first request (EngineCore.warm_up: the bf16 products' oneDNN
primitives, the heap of a full step, the weights moved onto huge pages); an offline engine
does none of it. With `--no-weight-huge-pages` beside it, the weights stay on 4 KiB pages.

`--other-engine-flags="FLAGS"` builds a second engine in the same process from the same
arguments with FLAGS added (e.g. `--no-weight-huge-pages`) and takes turns the same way
between the two engines' steps, each with its own B requests: an engine option's cost seen
under the same drift. (Each step then also finds the caches holding the other engine's
weights, so a step costs more than in one engine alone.)

`--other-decode-prefetch PLAN` takes turns the same way between the CPU's plan for the
decode attention's prefetches (kernels/paged_attention.py, `decode_prefetch()`) and PLAN, one
of `stream_next_item`, `own_tokens_ahead`: whether the CPU at hand takes the faster one.

`--spin-beside BUSY/PERIOD` (ms, e.g. `0.2/2`) runs a process beside the engine that spins
BUSY of every PERIOD ms while the steps are timed, as a server's API process and its clients
take the cores between and during steps: how much a step loses to CPU it does not get (each
operator's work is split in halves between the two threads, so a thread held back stalls
the other at the next barrier).

usage: python benchmarks/decode_step_cost.py [--batches 1,4,8,16,32,64] [--input-len 256]
           [--steps 20] [--cpu-time] [--warm-up] [--spin-beside BUSY/PERIOD]
           [--other-csrc DIR | --other-bf16-quantized-max-rows N | --other-decode-prefetch PLAN |
            --other-engine-flags="FLAGS"]
           [engine flags as for bench throughput]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

from tokenserve import SamplingParams
from tokenserve.benchmarks.datasets import random_token_prompts
from tokenserve.core.gc_heap import freeze_startup_heap
from tokenserve.engine.cli_args import add_engine_arguments, engine_args_from
from tokenserve.engine.llm_engine import LLMEngine
from tokenserve.kernels import build, paged_attention
from tokenserve.kernels.decode_layer import DecodeLayerOps
from tokenserve.model.fused_decode import FusedDecodeLayerStack
from tokenserve.model.layers.quantization.gguf import QuantizedWeight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,4,8,16,32,64")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="Decode steps timed per batch.")
    parser.add_argument("--cpu-time", action="store_true",
                        help="The calling thread's CPU time, not wall-clock time.")
    parser.add_argument("--other-csrc", default=None,
                        help="Another tree's kernels/csrc: its decode layer takes every other step.")
    parser.add_argument("--other-bf16-quantized-max-rows", type=int, default=None,
                        help="Every other step with this row limit for the bf16 block kernel.")
    parser.add_argument("--other-decode-prefetch", default=None,
                        choices=list(paged_attention.DECODE_PREFETCH),
                        help="Every other step with this plan for the decode attention's "
                             "prefetches.")
    parser.add_argument("--other-engine-flags", default=None,
                        help="A second engine with these flags added takes every other step.")
    parser.add_argument("--warm-up", action="store_true",
                        help="Run the engine core's idle-time warm-up first, as a server does.")
    parser.add_argument("--spin-beside", default=None, metavar="BUSY/PERIOD",
                        help="A process beside the engine spinning BUSY ms of every PERIOD ms "
                             "while the steps are timed (e.g. 0.2/2).")
    add_engine_arguments(parser, positional_model=False)
    args = parser.parse_args()
    batches = [int(n) for n in args.batches.split(",")]
    if args.steps < 1 or any(b < 1 for b in batches):
        raise SystemExit("--steps and every batch size must be at least 1.")
    other_limit = args.other_bf16_quantized_max_rows
    if other_limit is not None and (other_limit < 1 or args.other_csrc is not None):
        raise SystemExit("--other-bf16-quantized-max-rows takes a limit of at least 1, and not "
                         "with --other-csrc.")
    if args.other_decode_prefetch is not None and (args.other_csrc is not None
                                                   or other_limit is not None):
        raise SystemExit("--other-decode-prefetch takes turns with this tree's build and the "
                         "CPU's plan: not with --other-csrc or --other-bf16-quantized-max-rows.")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    spin = _spin_times(args.spin_beside) if args.spin_beside is not None else None

    engine = LLMEngine.from_engine_args(engine_args_from(args))
    engines = [engine]  # the engines by turn
    if args.other_engine_flags is not None:
        if args.other_csrc is not None or other_limit is not None or args.other_decode_prefetch:
            raise SystemExit("--other-engine-flags takes turns between two engines: not with "
                             "another --other-* option.")
        other_args = parser.parse_args(shlex.split(args.other_engine_flags),
                                       namespace=argparse.Namespace(**vars(args)))
        engines.append(LLMEngine.from_engine_args(engine_args_from(other_args)))
        print(f"other engine: this one's arguments and {args.other_engine_flags}")
    # The model and engine out of the collector's walks, as in a server's engine core and
    # LLM.generate (core/gc_heap.py): else full collections land in the timed steps.
    freeze_startup_heap()
    if args.warm_up:
        for each in engines:
            while each.engine_core.warm_up():
                pass
    max_num_seqs = engine.config.scheduler_config.max_num_seqs
    if max(batches) > max_num_seqs:
        raise SystemExit(f"A batch of {max(batches)} rows needs --max-num-seqs of at least that "
                         f"(it is {max_num_seqs}): the requests beyond it would wait for ones "
                         "that never finish.")
    # The fused decode layer's operators by turn (None: this tree's), a turn per engine.
    builds = [None] * len(engines)
    stack = None
    if args.other_csrc is not None:
        (stack,) = engine.engine_core.collective_rpc(_fused_stack)
        if stack is None or stack.max_rows == 0:
            raise SystemExit("--other-csrc: this model takes no fused decode steps (the fused "
                             "layer runs a GGUF model's blocks).")
        other_library = build.build("decode_layer", source_dir=args.other_csrc)
        print(f"other tree's decode layer: {other_library}")
        try:
            builds = [stack.ops, DecodeLayerOps(ctypes.CDLL(other_library))]
        except AttributeError as error:  # a tree from before ts_decode_layers
            raise SystemExit(f"--other-csrc: {error} (a tree from before it): time the two "
                             "trees in separate runs.") from error
    limits: list[int] = []  # the bf16 block kernel's row limit by turn
    if other_limit is not None:
        (blocks,) = engine.engine_core.collective_rpc(_bf16_blocks)
        (stack,) = engine.engine_core.collective_rpc(_fused_stack)
        if not blocks:
            raise SystemExit("--other-bf16-quantized-max-rows: no products on a bf16 block "
                             "kernel here (a bfloat16 GGUF model on the amx or avx512_bf16 "
                             "level).")
        limits = [_bf16_row_limit(blocks), other_limit]
        builds = [None, None]
        print(f"bf16 block kernel's row limit: {limits[0]}, other: {limits[1]}")
    plans: list[str | None] = []  # the decode attention's prefetch plan by turn
    if args.other_decode_prefetch is not None:
        plans = [None, args.other_decode_prefetch]
        builds = [None, None]
        print(f"decode prefetch: {paged_attention.decode_prefetch()} (this CPU's), other: "
              f"{args.other_decode_prefetch}")
    vocab_size = engine.config.model_config.vocab_size
    # Room for every step until the last prompt is in (at least a token each) and the timed
    # ones: the first requests decode while the later prompts' chunks are computed.
    max_tokens = args.steps + 2 + max(batches) * args.input_len
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if len(builds) == 1:
        print("decode rows   median ms   fastest ms")
    else:
        print("decode rows   median ms   fastest ms   other's:  median ms   fastest ms"
              "   median / other's")
    with _spinning_beside(spin):
        for batch in batches:
            prompts = random_token_prompts(batch, args.input_len, vocab_size, seed=batch)
            for each in engines:
                for index, prompt in enumerate(prompts):
                    each.add_request(f"{batch}-{index}", {"prompt_token_ids": prompt}, params)
                started: set[str] = set()
                while len(started) < batch:  # until every request has its first token
                    started.update(
                        out.request_id for out in each.step() if out.outputs[0].token_ids
                    )
            times: list[list[float]] = [[] for _ in builds]
            for step in range(args.steps * len(builds)):
                turn = step % len(builds)
                if limits:
                    _set_bf16_row_limit(blocks, stack, limits[turn])
                elif plans:
                    paged_attention.force_decode_prefetch(plans[turn])
                elif stack is not None:
                    stack.ops = builds[turn]
                stepping = engines[turn % len(engines)]
                begin = clock()
                stepping.step()
                times[turn].append(clock() - begin)
            for each in engines:
                each.abort_request([f"{batch}-{index}" for index in range(batch)])
                while each.has_unfinished_requests():
                    each.step()
            if limits:
                _set_bf16_row_limit(blocks, stack, limits[0])
            elif plans:
                paged_attention.force_decode_prefetch(None)
            elif stack is not None:
                stack.ops = builds[0]
            medians = [statistics.median(t) * 1e3 for t in times]
            columns = "".join(f"   {median:9.1f}   {min(t) * 1e3:10.1f}"
                              for median, t in zip(medians, times))
            ratio = f"   {medians[0] / medians[1]:16.3f}" if len(builds) > 1 else ""
            print(f"{batch:11d}{columns}{ratio}")


# The process --spin-beside starts: BUSY ms of spinning, then sleep to the end of PERIOD.
_SPIN = """
import sys, time
busy, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(max(period - busy, 0.0))
"""


@contextlib.contextmanager
def _spinning_beside(spin: tuple[float, float] | None) -> Iterator[None]:
    """With `spin` (BUSY, PERIOD ms), a process spinning beside this one until the block ends."""
    if spin is None:
        yield
        return
    print(f"beside: a process spinning {spin[0]} ms of every {spin[1]} ms")
    spinner = subprocess.Popen([sys.executable, "-c", _SPIN, str(spin[0]), str(spin[1])])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def _spin_times(value: str) -> tuple[float, float]:
    """--spin-beside's BUSY/PERIOD, in ms."""
    try:
        busy, period = (float(part) for part in value.split("/"))
    except ValueError:
        raise SystemExit(f"--spin-beside takes BUSY/PERIOD in ms (e.g. 0.2/2), not {value!r}.")
    if not 0 < busy <= period:
        raise SystemExit("--spin-beside: BUSY must be above 0 and at most PERIOD.")
    return busy, period


def _bf16_blocks(worker) -> list[QuantizedWeight]:
    """The worker's model's GGUF weights whose products take a bf16 block kernel."""
    return [module.blocks for module in worker.model_runner.model.modules()
            if isinstance(getattr(module, "blocks", None), QuantizedWeight)
            and (module.blocks.uses_amx or module.blocks.uses_dp)]


def _bf16_row_limit(blocks: list[QuantizedWeight]) -> int:
    return blocks[0].amx_max_rows if blocks[0].uses_amx else blocks[0].dp_max_rows


def _set_bf16_row_limit(blocks: list[QuantizedWeight], stack: FusedDecodeLayerStack | None,
                        limit: int) -> None:
    """The bf16 block kernel's row limit, on every weight and the fused layer stack."""
    for weight in blocks:
        if weight.uses_amx:
            weight.amx_max_rows = limit
        else:
            weight.dp_max_rows = limit
    if stack is not None:
        stack.reset_row_limit()


def _fused_stack(worker) -> FusedDecodeLayerStack | None:
    """The worker's model's fused decode layer stack, if it has one."""
    for module in worker.model_runner.model.modules():
        stack = getattr(module, "layer_stack", None)
        if isinstance(stack, FusedDecodeLayerStack):
            return stack
    return None


if __name__ == "__main__":
    main()
