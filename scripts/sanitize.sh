#!/usr/bin/env bash
# Builds Tessera with sanitizers into build-<sanitizers>/ and runs tests there.
#   scripts/sanitize.sh                          ASan + UBSan, the unit tests (what CI runs)
#   scripts/sanitize.sh thread                   TSan, the runtime and collective tests
#   scripts/sanitize.sh address,undefined -L integration    any ctest arguments after the first
# Every finding is fatal (the test fails and prints the report). Third-party libraries (TBB,
# OpenBLAS, UCX) are not instrumented; tests/sanitizers/ holds the suppressions for what their
# uninstrumented code makes the sanitizers see, each with its reason.
# scripts/sanitized_build.sh builds (Clang 15, so the thread-safety annotations are checked too;
# core/thread_annotations.h); TESSERA_SANITIZE_CC, TESSERA_SANITIZE_CXX and TESSERA_WERROR
# work as it says.
set -euo pipefail
cd "$(dirname "$0")/.."
sanitizers=${1:-address,undefined}
shift || true
# The runtime: threads, the executor, the object store, control and data planes, the scheduler
# and the collectives (unit tests; processes of integration tests are not traced).
runtime_tests='Executor|ObjectStore|Rpc|Connection|DataPlane|Scheduler|Collective|Loopback|Rendezvous|GraphRunner'
# Tests that take every file descriptor away from the process: a sanitizer runtime needs some
# (UBSan's first check of an object's type probes memory through a pipe, and reports the object
# as bad when it cannot make one; the symbolizer is a child on a socket pair), so under it they
# report what the tool could not do, not what the code did. They run in every other build.
out_of_descriptors='ListenerTest.OutOfDescriptorsItShedsAndPausesInsteadOfSpinning'
# The `numerics` reruns (tests/run_with_coretype.sh) run the same Tessera code under another
# OpenBLAS kernel family: OpenBLAS is not instrumented, so under a sanitizer they repeat what the
# plain run already traced.
runtime_only=0
if [[ $# -eq 0 ]]; then
  if [[ "$sanitizers" == *thread* ]]; then
    set -- -L unit -LE numerics -R "$runtime_tests" -E "$out_of_descriptors"
    runtime_only=1
  else
    set -- -L unit -LE numerics -E "$out_of_descriptors"
  fi
fi
scripts/install_deps.sh
# Only the unit tests (and what they link) when only unit tests run: half the build; for the
# runtime's tests, only the unit-test executables that hold them (a third of them).
targets=(all)
[[ " $* " == *" -L unit "* ]] && targets=(unit_tests)
[[ $runtime_only -eq 1 ]] && read -r -a targets < <(scripts/test_targets.py "$runtime_tests" unit)
dir=$(scripts/sanitized_build.sh "$sanitizers" "${targets[@]}")
suppressions="$PWD/tests/sanitizers"
# UCX's memory hooks (libucm patches mmap/madvise/malloc in every loaded library) fight the
# sanitizers' own interceptors (TSan crashes in ucm_madvise at thread start). Tessera needs none
# of them: it registers no memory with a cache (shared memory and TCP transports).
export UCX_MEM_MMAP_HOOK_MODE=none UCX_MEM_MALLOC_HOOKS=no
# Under TSan, worker processes (integration tests) run one executor thread: fewer TBB hand-offs,
# which TSan cannot see (tests/sanitizers/tsan.supp).
[[ "$sanitizers" == *thread* ]] && export TESSERA_CPU_THREADS=${TESSERA_CPU_THREADS:-1}
# The symbolizer of the compiler's LLVM: without one, reports have no function names and the
# suppressions (which match names) match nothing.
symbolizer=""
for candidate in /usr/lib/llvm-15/bin/llvm-symbolizer "$(command -v llvm-symbolizer || true)"; do
  if [[ -n "$candidate" && -x "$candidate" ]]; then
    symbolizer="external_symbolizer_path=$candidate:"
    break
  fi
done
export ASAN_OPTIONS="${symbolizer}detect_leaks=1:abort_on_error=0:${ASAN_OPTIONS:-}"
export LSAN_OPTIONS="${symbolizer}suppressions=$suppressions/lsan.supp:print_suppressions=0:${LSAN_OPTIONS:-}"
export UBSAN_OPTIONS="${symbolizer}print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
export TSAN_OPTIONS="${symbolizer}suppressions=$suppressions/tsan.supp:halt_on_error=1:second_deadlock_stack=1:${TSAN_OPTIONS:-}"
cd "$dir"
exec ctest --output-on-failure -j "$(nproc)" "$@"
