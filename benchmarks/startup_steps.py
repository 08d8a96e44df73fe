"""The engine process's part of `tokenserve serve`'s start, piece by piece, two source trees
interleaved (A, B, A, B, ...), each run a fresh interpreter.

The pieces are what the engine-core process does on the way to the first answer: import
its modules (`import_executor_class("uni")`), build the configuration of the default model,
build the `EngineCore` (model loaded, KV cache mapped), then run one chat-sized request of 8
tokens. Each gets its wall seconds and its CPU seconds (user + system, every thread of the
process): on a shared machine the CPU seconds say more about the work than the wall seconds.
Runs start from an empty directory so that PYTHONPATH alone picks the tree.

`--process api` times the API process's pieces instead: parse the `serve` flags (the
engine arguments), build the configuration, import the HTTP stack (`api_server`), load the
tokenizer; the engine's pieces (the default) and the API process's run side by side in a
`tokenserve serve`, and the later of the two is the start's critical path.

usage: python benchmarks/startup_steps.py [--process engine|api] [--pairs N] [--output F] TREE_A TREE_B
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# Runs in the child: the pieces, then one line "ROWS {json}".
STEPS = r'''
import json, resource, time

def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

rows, last = {}, (cpu(), time.perf_counter())
def mark(name):
    global last
    now = (cpu(), time.perf_counter())
    rows[name] = {"cpu": now[0] - last[0], "wall": now[1] - last[1]}
    last = now

from tokenserve.executor.backends import import_executor_class
import_executor_class("uni"); mark("imports")
from tokenserve.engine.engine_args import EngineArgs
config = EngineArgs().create_engine_config(); mark("config")
from tokenserve.core.engine_core import EngineCore
core = EngineCore(config, None); mark("model load")
from tokenserve.core.request import Request
from tokenserve.sampling_params import SamplingParams
prompt = list(range(1000, 1030))  # a short chat's length
core.add_request(Request("r", prompt, SamplingParams(temperature=0, max_tokens=8), None))
while core.has_unfinished_requests():
    core.step()
mark("first request")
rows["total"] = {k: sum(row[k] for row in rows.values()) for k in ("cpu", "wall")}
print("ROWS " + json.dumps(rows))
'''


# The API process's pieces, timed with the same preamble (`mark`).
API_STEPS = STEPS[:STEPS.index("from tokenserve.executor")] + r'''
from tokenserve.entrypoints.cli import build_parser
from tokenserve.engine.cli_args import engine_args_from
engine_args = engine_args_from(build_parser(serve_only=True).parse_args(["serve"]))
mark("parse flags")
config = engine_args.create_engine_config(); mark("config")
import tokenserve.entrypoints.openai.api_server
mark("http stack")
from tokenserve.model.loader import load_tokenizer
load_tokenizer(config.model_config.files, config.model_config.tokenizer); mark("tokenizer")
rows["total"] = {k: sum(row[k] for row in rows.values()) for k in ("cpu", "wall")}
print("ROWS " + json.dumps(rows))
'''


def run_steps(tree: str, script: str = STEPS) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("ROWS ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"{tree}: the steps failed:\n{result.stderr[-3000:]}")
    return json.loads(lines[-1][len("ROWS "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tree_a")
    parser.add_argument("tree_b")
    parser.add_argument("--process", choices=("engine", "api"), default="engine")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--output", default="startup_steps.json")
    args = parser.parse_args()
    trees = (("a", os.path.abspath(args.tree_a)), ("b", os.path.abspath(args.tree_b)))
    output = os.path.abspath(args.output)
    os.chdir(tempfile.mkdtemp(prefix="startup-steps-"))  # neither tree on sys.path by accident
    records = []
    for pair in range(args.pairs):
        for name, tree in trees:
            load = os.getloadavg()[0]
            records.append({"tree": name, "path": tree, "pair": pair, "load1": load,
                            "steps": run_steps(tree, API_STEPS if args.process == "api" else STEPS)})
            print(json.dumps(records[-1]), flush=True)
            with open(output, "w") as file:
                json.dump(records, file, indent=1)


if __name__ == "__main__":
    main()
