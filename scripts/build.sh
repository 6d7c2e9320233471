#!/usr/bin/env bash
# Configures and builds Tessera into build/ (Release, Ninja). Extra arguments go to CMake.
# TESSERA_WERROR=ON in the environment makes warnings errors (.ci/run sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
werror=()
[[ -n "${TESSERA_WERROR:-}" ]] && werror=(-DTESSERA_WERROR="$TESSERA_WERROR")
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${werror[@]}" "$@"
cmake --build build -j "$jobs"
