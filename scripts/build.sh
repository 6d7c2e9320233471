#!/usr/bin/env bash
# Configures and builds Tessera into build/ (Release, Ninja). Extra arguments go to CMake.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build build -j "$jobs"
