#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (CTest; GPU tests skip without a GPU).
# Extra arguments go to ctest, e.g. scripts/test.sh -L unit
# Ends with how long each part took (12-21 minutes in all on the 2-core VM, docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
scripts/install_deps.sh
installed=$(date +%s)
scripts/build.sh
built=$(date +%s)
status=0
# One test more than the processors: a fifth of the processors' time idles at one a processor
# (tests that wait on processes, timeouts, a long test's tail); on the 2-core VM -j3 ran the
# suite in 349-354 s against 380-381 s at -j2, all passing (docs/benchmarks.md, 2026-12-07).
(cd build && ctest --output-on-failure -j "$(($(nproc) + 1))" "$@") || status=$?
finished=$(date +%s)
# A failed test's assertions again, last, where a reader of the log's tail sees them (its whole
# output is above, in ctest's order): each failure's line and the 5 after it, cut to 160
# characters, for the first 3 failed tests; a test that failed without an assertion (a crash, a
# timeout) its last 8 lines of output.
failures=build/Testing/Temporary/LastTestsFailed.log
if [[ $status != 0 && -f $failures && -f build/Testing/Temporary/LastTest.log ]]; then
  echo "test.sh: the failed tests' assertions (their whole output is above):"
  awk -F: 'FNR == NR { if (++failed <= 3) wanted[$2] = 1; next }
    /^[0-9]+\/[0-9]+ Test: / { name = $0; sub(/^[^:]*: /, "", name); shown = 0; kept = 0 }
    !(name in wanted) { next }
    /^<end of output>$/ {
      after = 0
      if (!shown) {
        print "  " name ": no assertion failed; its last lines:"
        for (i = (kept > 8 ? kept - 8 : 0); i < kept; ++i) print "    " substr(last[i % 8], 1, 160)
      }
      name = ""
      next
    }
    { last[kept++ % 8] = $0 }
    /: Failure$/ { after = 6; if (!shown++) print "  " name ":" }
    after > 0 { print "    " substr($0, 1, 160); --after }' \
    "$failures" build/Testing/Temporary/LastTest.log | head -n 60
fi
echo "test.sh: packages $((installed - started)) s, build $((built - installed)) s," \
  "tests $((finished - built)) s: $((finished - started)) s in all (ctest exit $status)"
exit "$status"
