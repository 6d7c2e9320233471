#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (CTest; GPU tests skip without a GPU).
# Extra arguments go to ctest, e.g. scripts/test.sh -L unit
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
cd build
exec ctest --output-on-failure -j "$(nproc)" "$@"
