"""`tokenserve serve`'s start, two source trees interleaved (A, B, A, B, ...) on one machine.

Each run is one `measure_start` of `tokenserve bench startup` (tokenserve/benchmarks/
startup.py) with PYTHONPATH set to the tree under test, so that both see the same load; a
run waits until the machine has MIN_AVAILABLE_GIB of memory available (a tree that zeroes
its whole KV cache at start needs it). Bytecode is written (PYTHONDONTWRITEBYTECODE unset),
as an installed package has it. The figures of docs/STARTUP.md came from:

    git archive b7bd1b2 tokenserve | tar -x -C /tmp/base      # the code before the change
    python benchmarks/startup_ab.py --pairs 3 --output ab.json /tmp/base . [-- serve args]

usage: python benchmarks/startup_ab.py [--pairs N] [--output F] TREE_A TREE_B [-- serve args]
(the options first: whatever follows the trees goes to `tokenserve serve`). The servers run
from an empty directory: `python -m` puts the working directory first on sys.path, so a run
started in a source tree would import that tree whatever PYTHONPATH says.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from tokenserve.benchmarks.startup import measure_start

MIN_AVAILABLE_GIB = 7


def available_gib() -> float:
    with open("/proc/meminfo") as file:
        for line in file:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024**2
    return float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tree_a")
    parser.add_argument("tree_b")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--output", default="startup_ab.json")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("serve_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    serve_args = [arg for arg in args.serve_args if arg != "--"]
    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    trees = (("a", os.path.abspath(args.tree_a)), ("b", os.path.abspath(args.tree_b)))
    output = os.path.abspath(args.output)
    os.chdir(tempfile.mkdtemp(prefix="startup-ab-"))  # neither tree on sys.path by accident
    rows = []
    for pair in range(args.pairs):
        for name, tree in trees:
            while available_gib() < MIN_AVAILABLE_GIB:
                time.sleep(5)
            env = {**base_env, "PYTHONPATH": tree}
            load = os.getloadavg()[0]
            run = measure_start(serve_args, env, args.timeout)
            rows.append({"tree": name, "path": tree, "pair": pair, "load1": load, **vars(run)})
            print(json.dumps(rows[-1]), flush=True)
            with open(output, "w") as file:
                json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
