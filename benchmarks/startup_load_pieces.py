"""The default model's load in the engine process, piece by piece, on one torch thread or on
the pool, alone or beside a busy process (as the API process is during `tokenserve serve`).

Each run is a fresh interpreter that loads the model as `get_model` does (warm weight cache:
run a server or this once first) and prints, per piece, wall seconds, CPU seconds (all
threads) and minor page faults: build the model, read the cache entry (checksums), copy the
weights into the parameters, join the GGUF blocks, prepack for oneDNN; then one 8-token
request. Each run loads one of three ways, in turns, so all see the same load: on one torch
thread ("1"), on torch's pool ("2" on two cores), or as `get_model` loads a small model
("workers": the operations spread over one worker thread per core, each on one torch
thread; model/load_threads.py). Its prepacking is timed whichever way; a server's engine
leaves it to its idle time after "ready" (model/registry.py, `pack_weights=False`).

usage: python benchmarks/startup_load_pieces.py [--runs N] [--busy]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

PIECES = r'''
import json, resource, sys, time
import torch
def now():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), usage.ru_utime + usage.ru_stime, usage.ru_minflt
rows, last = {}, now()
def mark(name):
    global last
    current = now()
    rows[name] = {k: round(b - a, 4) for k, a, b in zip(("wall", "cpu", "faults"), last, current)}
    last = current
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.model import registry
from tokenserve.model.layers.weight_loading import copies_submitted_to
from tokenserve.model.load_threads import LoadWorkers
from tokenserve.model.loader import iterate_model_weights
from tokenserve.model.weight_cache import WeightDtypes
config = EngineArgs().create_engine_config()
def get_model(model_config, attention, kernel_config, device, parallel=None, pack_weights=True):
    threads = torch.get_num_threads()
    mode = sys.argv[1]
    workers = LoadWorkers(threads if mode == "workers" else 1)
    torch.set_num_threads(1 if mode == "workers" else int(mode))
    mark("before")
    model = registry.build_model(model_config, attention, kernel_config, parallel); mark("build")
    weights = list(iterate_model_weights(model_config.files, WeightDtypes.of(model)))
    mark("read entry")
    with copies_submitted_to(workers.submit):
        model.load_weights(weights)
    workers.wait(); mark("load_weights")
    def join(module):
        module.blocks = module.quant_method._join(module.gguf_parts, tuple(module.weight.shape))
        module.gguf_parts = {}
    for module in model.modules():
        if getattr(module, "gguf_parts", None):
            workers.submit(join, module)
    workers.wait(); mark("join blocks")
    registry.process_weights_after_loading(model, workers); mark("prepack")
    workers.close()
    torch.set_num_threads(threads)
    return model
import tokenserve.worker.model_runner as runner
runner.get_model = get_model
from tokenserve.core.engine_core import EngineCore
from tokenserve.core.request import Request
from tokenserve.sampling_params import SamplingParams
core = EngineCore(config, None); mark("rest of EngineCore")
core.add_request(Request("r", list(range(1000, 1030)), SamplingParams(temperature=0, max_tokens=8), None))
while core.has_unfinished_requests():
    core.step()
mark("first request")
rows.pop("before")
print("ROWS " + json.dumps(rows))
'''


def run(mode: str, busy: bool) -> dict:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        result = subprocess.run([sys.executable, "-c", PIECES, mode], env=os.environ,
                                capture_output=True, text=True, check=False)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    lines = [line for line in result.stdout.splitlines() if line.startswith("ROWS ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(lines[-1][len("ROWS "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--busy", action="store_true", help="a busy process beside each run")
    args = parser.parse_args()
    os.chdir(tempfile.mkdtemp(prefix="load-pieces-"))  # PYTHONPATH picks the tree
    pool = str(os.cpu_count() or 1)
    for index in range(args.runs):
        for mode in ("1", pool, "workers"):
            record = {"run": index, "threads": mode, "busy": args.busy,
                      "load1": os.getloadavg()[0], "pieces": run(mode, args.busy)}
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
