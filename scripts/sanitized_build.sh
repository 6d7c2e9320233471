#!/usr/bin/env bash
# Configures and builds Tessera with sanitizers into build-<sanitizers>/ (scripts/sanitize.sh's
# tests and scripts/fuzz.sh's fuzzers share it, so CI compiles the instrumented libraries once).
#   scripts/sanitized_build.sh SANITIZERS TARGET...
# SANITIZERS: address,undefined or thread. Clang 15 by default (scripts/install_deps.sh says why
# that version; it also checks the thread-safety annotations, -Wthread-safety);
# TESSERA_SANITIZE_CC and TESSERA_SANITIZE_CXX name other compilers. With Clang, the
# address,undefined build is also instrumented for libFuzzer's coverage (TESSERA_FUZZ: the
# fuzz/ targets can be built in it; the tests run as before). TESSERA_WERROR=ON in the
# environment makes every warning an error (.ci/run sets it). Prints the build directory last.
set -euo pipefail
cd "$(dirname "$0")/.."
sanitizers=$1
shift
dir="build-${sanitizers//,/-}"
cc=${TESSERA_SANITIZE_CC:-clang-15}
cxx=${TESSERA_SANITIZE_CXX:-clang++-15}
options=()
[[ -n "${TESSERA_WERROR:-}" ]] && options+=(-DTESSERA_WERROR="$TESSERA_WERROR")
fuzz=OFF
[[ "$sanitizers" == "address,undefined" && "$cxx" == clang* ]] && fuzz=ON
# -O1 -g1 (line tables only): the reports' stacks name files and lines, without the compile and
# link time of full debug information (the kernels' own -O3 stays: ops/, collectives/).
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTESSERA_SANITIZE="$sanitizers" \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" -DTESSERA_FUZZ="$fuzz" "${options[@]}" \
  -DTESSERA_BUILD_BENCH=OFF -DTESSERA_ENABLE_CUDA=OFF >&2
cmake --build "$dir" -j "$(nproc)" --target "$@" >&2
echo "$dir"
