#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` and `llama-batched-bench` for the side-by-side runs, from
# the llama.cpp sources inside the `llama-cpp-python` sdist on PyPI (the only route to them
# on a machine that reaches nothing but the package registries). CPU only, -march=native.
#
# usage: benchmarks/build_llama_cpp.sh [DIR]     (default: /tmp/peers/llama.cpp)
#   The binaries land in DIR/bin; run_side_by_side.sh looks there (LLAMA_CPP_DIR=DIR).
#   LLAMA_CPP_PYTHON_VERSION=0.3.16   the sdist whose vendored llama.cpp is built
# Needs cmake and a C++ compiler; ~6 minutes on 2 cores.
set -euo pipefail

DIR=${1:-/tmp/peers/llama.cpp}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.16}
PYTHON=${PYTHON:-python3}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"

if [ ! -f "$SRC/CMakeLists.txt" ]; then
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$DIR" \
      "llama-cpp-python==$VERSION"
  tar -xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
fi
GENERATOR=()
command -v ninja > /dev/null && GENERATOR=(-G Ninja)
cmake -S "$SRC" -B "$DIR/build" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON
cmake --build "$DIR/build" --target llama-server llama-batched-bench -j "$(nproc)"
mkdir -p "$DIR/bin"
# The binaries find their shared libraries through their RPATH (the build tree).
ln -sf "$DIR/build/bin/llama-server" "$DIR/bin/llama-server"
ln -sf "$DIR/build/bin/llama-batched-bench" "$DIR/bin/llama-batched-bench"
echo "llama.cpp (llama-cpp-python $VERSION's sources) built: $DIR/bin"
