#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) with Clang 15, ASan and UBSan into build-address-undefined/
# (scripts/sanitized_build.sh; shared with scripts/sanitize.sh) and runs each for a bounded time
# from its committed corpus (fuzz/corpus/<target>/), printing the executions per target. Any
# crash, sanitizer report, leak, timeout or out-of-memory fails the script; the input that caused
# it is left as build-address-undefined/findings/<target>-<kind>-<hash> (add it to the target's
# corpus with the fix, so it is replayed on every run from then on).
#   scripts/fuzz.sh                       every target, TESSERA_FUZZ_SECONDS (default 45) each
#   scripts/fuzz.sh fuzz_http_handler     the targets named
#   scripts/fuzz.sh --seeds               rewrite fuzz/corpus/<target>/seed-* from the seeds each
#                                         target defines (fuzz/fuzz_util.h), then stop
# Inputs the fuzzer finds interesting are kept in build-address-undefined/corpus/<target>/ (not
# committed): later runs on the same machine start from them too. Only the fuzzers and the
# libraries they link are built. TESSERA_WERROR=ON in the environment makes every warning an
# error (.ci/run sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${TESSERA_FUZZ_SECONDS:-45}
all_targets=(fuzz_control_plane fuzz_data_plane_wire fuzz_http_handler)
seeds=0
targets=()
for arg in "$@"; do
  if [[ "$arg" == "--seeds" ]]; then seeds=1; else targets+=("$arg"); fi
done
[[ ${#targets[@]} -eq 0 ]] && targets=("${all_targets[@]}")
scripts/install_deps.sh
# The fuzzers are built in the ASan + UBSan build that scripts/sanitize.sh runs the unit tests
# in: its libraries are already instrumented for coverage, so CI compiles them once.
dir=$(scripts/sanitized_build.sh address,undefined "${targets[@]}")
[[ -x "$dir/bin/${targets[0]}" ]] || {
  echo "fuzz: $dir has no fuzzers: the fuzz targets need Clang (TESSERA_SANITIZE_CXX=clang++-15)" >&2
  exit 1
}

if [[ $seeds -eq 1 ]]; then
  for target in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$target"
    rm -f "fuzz/corpus/$target"/seed-*
    TESSERA_FUZZ_WRITE_SEEDS="fuzz/corpus/$target" "$dir/bin/$target"
  done
  exit 0
fi

symbolizer=""
if [[ -x /usr/lib/llvm-15/bin/llvm-symbolizer ]]; then
  symbolizer="external_symbolizer_path=/usr/lib/llvm-15/bin/llvm-symbolizer:"
fi
suppressions="$PWD/tests/sanitizers"
export ASAN_OPTIONS="${symbolizer}detect_leaks=1:${ASAN_OPTIONS:-}"
export LSAN_OPTIONS="${symbolizer}suppressions=$suppressions/lsan.supp:print_suppressions=0:${LSAN_OPTIONS:-}"
export UBSAN_OPTIONS="${symbolizer}print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
export UCX_MEM_MMAP_HOOK_MODE=none UCX_MEM_MALLOC_HOOKS=no
mkdir -p "$dir/findings"
summary=()
status=0
for target in "${targets[@]}"; do
  work="$dir/corpus/$target"
  log="$dir/$target.log"
  mkdir -p "$work" "fuzz/corpus/$target"
  echo "fuzz: $target for ${seconds} s"
  # The first directory receives new inputs; the committed corpus is only read.
  if "$dir/bin/$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$dir/findings/$target-" \
    "$work" "fuzz/corpus/$target" >"$log" 2>&1; then
    result=ok
  else
    result=FAILED
    status=1
    tail -n 60 "$log"
  fi
  executions=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  coverage=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 || true)
  summary+=("$(printf '%-22s %-6s %12s executions in %s s  %s' "$target" "$result" \
    "${executions:-?}" "$seconds" "$coverage")")
done
echo "fuzz: summary"
printf '  %s\n' "${summary[@]}"
exit $status
