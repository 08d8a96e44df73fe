#!/usr/bin/env bash
# Resolves every dependency once into the locks that scripts/install.sh installs from:
#   requirements/lock.txt       the engine (pyproject's dependencies, CPU torch, build tools)
#   requirements/lock-test.txt  the same plus the `test`, `bench` and `ray` extras
# The test lock is constrained by the runtime lock, so the two agree on every shared package.
# A reviewed change either way: run the whole suite on the new lock.
#   bash scripts/lock.sh             # keep every pin that still fits; pin what is new
#   bash scripts/lock.sh --upgrade   # move every pin to the newest release that fits
set -euo pipefail
cd "$(dirname "$0")/../requirements"
PYTHON="${PYTHON:-python3}"
$PYTHON -m pip install --quiet "pip-tools==7.6.2"
COMPILE=($PYTHON -m piptools compile --quiet --generate-hashes --allow-unsafe --strip-extras
         --no-emit-find-links --no-emit-index-url --resolver=backtracking "$@")
"${COMPILE[@]}" -o lock.txt ../pyproject.toml build.in torch-cpu.in
"${COMPILE[@]}" --extra test --extra bench --extra ray -c lock.txt -o lock-test.txt \
    ../pyproject.toml build.in torch-cpu.in
