#!/usr/bin/env bash
# Configures and builds Tessera into build/ (Release, Ninja). Extra arguments go to CMake.
#   scripts/build.sh           everything: the libraries, binaries, tests and benchmarks
#   scripts/build.sh --main    only the tessera binary and train_gpt2, without tests
#                              or benchmarks (the README's first command, scripts/train.sh: a few
#                              minutes on 2 cores)
# Either compiles the CUDA backend (and, with the tests, the GPU tests) only where a GPU is visible
# (nvidia-smi lists one) or TESSERA_CUDA=ON asks for it: .ci/run does, so CI compiles it on a
# machine without a GPU; TESSERA_CUDA=OFF leaves it out everywhere.
# TESSERA_WERROR=ON in the environment makes warnings errors (.ci/run sets it). Both forms use
# the same build/ and name every option, so one after the other rebuilds only what differs.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
werror=()
[[ -n "${TESSERA_WERROR:-}" ]] && werror=(-DTESSERA_WERROR="$TESSERA_WERROR")
cuda="${TESSERA_CUDA:-}"
if [[ -z "$cuda" ]]; then
  cuda=OFF
  if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q "^GPU "; then
    cuda=ON
  fi
fi
if [[ "${1:-}" == --main ]]; then
  shift
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${werror[@]}" \
    -DTESSERA_BUILD_TESTS=OFF -DTESSERA_BUILD_BENCH=OFF -DTESSERA_ENABLE_CUDA="$cuda" "$@"
  cmake --build build -j "$jobs" --target tessera train_gpt2
  exit 0
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${werror[@]}" \
  -DTESSERA_BUILD_TESTS=ON -DTESSERA_BUILD_BENCH=ON -DTESSERA_ENABLE_CUDA="$cuda" "$@"
cmake --build build -j "$jobs"
