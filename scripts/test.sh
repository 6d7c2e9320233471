#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (CTest; GPU tests skip without a GPU).
# Extra arguments go to ctest, e.g. scripts/test.sh -L unit
# Ends with how long each part took (15-30 minutes in all on 2 cores, docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
scripts/install_deps.sh
installed=$(date +%s)
scripts/build.sh
built=$(date +%s)
status=0
(cd build && ctest --output-on-failure -j "$(nproc)" "$@") || status=$?
finished=$(date +%s)
echo "test.sh: packages $((installed - started)) s, build $((built - installed)) s," \
  "tests $((finished - built)) s: $((finished - started)) s in all (ctest exit $status)"
exit "$status"
