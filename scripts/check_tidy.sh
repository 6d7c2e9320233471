#!/usr/bin/env bash
# Runs clang-tidy (the checks in .clang-tidy, Clang's thread-safety analysis among them) on every
# C++ source tracked by git (not CUDA .cu), in parallel, with the compile database of a build.
# Every finding is an error.
#   scripts/check_tidy.sh                  check; findings fail (those in deferred files: below)
#   scripts/check_tidy.sh --report         also list every deferred file's findings in full
#   scripts/check_tidy.sh FILE...          only these files (paths from the repository root)
# The build directory is build/ (TESSERA_TIDY_BUILD_DIR to change it), configured here when it
# has no compile_commands.json yet; generated headers (the Cap'n Proto schema) are built first.
# TESSERA_TIDY_JOBS: how many clang-tidy processes at once (default: one per processor).
#
# Deferred: files that other branches are restructuring have their findings counted and printed
# but do not fail the check until those branches land. Take a file off the list once fixed.
set -euo pipefail
cd "$(dirname "$0")/.."
deferred=(
  # Being split on branch `splits`: fixed there, or here once it has landed.
  'client/*' 'ops/standard_ops.*' 'ops/layer_program.*' 'core/transport/ucx_data_plane.*'
  'launcher/tessera_main.cc' 'bench/*'
  'tests/unit/scheduler_core_test.cc' 'tests/unit/executor_test.cc'
  'tests/unit/scheduler_test_graphs.h'
)
report=0
if [[ "${1:-}" == "--report" ]]; then
  report=1
  shift
fi

# Clang 15's (scripts/install_deps.sh says why not Debian's default); TESSERA_CLANG_TIDY names
# another.
tidy=${TESSERA_CLANG_TIDY:-clang-tidy-15}
command -v "$tidy" >/dev/null || {
  echo "check_tidy: $tidy is not installed (scripts/install_deps.sh installs it)" >&2
  exit 1
}
build=${TESSERA_TIDY_BUILD_DIR:-build}
if [[ ! -f "$build/compile_commands.json" ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
# Headers generated at build time, which the sources include.
mapfile -t generated < <(ninja -C "$build" -t targets all | sed -n 's|^\(generated/[^:]*\.h\): .*|\1|p')
[[ ${#generated[@]} -eq 0 ]] || ninja -C "$build" "${generated[@]}" >/dev/null

if [[ $# -gt 0 ]]; then
  files=("$@")
else
  mapfile -t files < <(git ls-files '*.cc')
fi
# Sources without a compile command (built elsewhere, e.g. examples/out_of_tree against the
# installed SDK) cannot be checked.
mapfile -t known < <(python3 -c 'import json, os, sys
for entry in json.load(open(sys.argv[1])):
    print(os.path.relpath(os.path.join(entry["directory"], entry["file"])))' \
  "$build/compile_commands.json")
declare -A in_database=()
for file in "${known[@]}"; do in_database[$file]=1; done
checked=()
for file in "${files[@]}"; do
  if [[ -n "${in_database[$file]:-}" ]]; then
    checked+=("$file")
  else
    echo "check_tidy: skipped $file (no compile command in $build)"
  fi
done

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
started=$(date +%s)
# One clang-tidy per file; its findings go to a file of its own. Exit codes are not used: a file
# that does not parse prints errors, which count too. -Wno-error: a -Werror build's compiler
# warnings are the compiler's to report (the checks in .clang-tidy are tidy's).
printf '%s\n' "${checked[@]}" | xargs -P "${TESSERA_TIDY_JOBS:-$(nproc)}" -I{} sh -c \
  '"$4" -p "$1" --quiet --extra-arg=-Wno-error "$2" > "$3/$(echo "$2" | tr / @).log" 2>&1 || true' \
  _ "$build" {} "$out" "$tidy"

# A finding is "path:line:col: warning|error: text [check]"; one in a header is reported by
# every file that includes it, so each is counted once.
findings=$(cat "$out"/*.log | grep -E '^[^ :]+:[0-9]+:[0-9]+: (warning|error): ' |
  sed "s|^$PWD/||" | sort -u || true)
is_deferred() {
  local pattern
  for pattern in "${deferred[@]}"; do
    # shellcheck disable=SC2053  # the pattern is a glob
    [[ "$1" == $pattern ]] && return 0
  done
  return 1
}
failing=""
deferred_found=""
while IFS= read -r line; do
  [[ -z "$line" ]] && continue
  if is_deferred "${line%%:*}"; then
    deferred_found+="$line"$'\n'
  else
    failing+="$line"$'\n'
  fi
done <<< "$findings"
count() { grep -c . <<< "$1" || true; }
elapsed=$(($(date +%s) - started))
if [[ -n "$deferred_found" ]]; then
  echo "check_tidy: $(count "$deferred_found") finding(s) in deferred files (not failing), per file:"
  cut -d: -f1 <<< "${deferred_found%$'\n'}" | sort | uniq -c | sort -rn | sed 's/^/  /'
  [[ $report -eq 1 ]] && printf '%s' "$deferred_found"
fi
if [[ -n "$failing" ]]; then
  # The full messages (with the code and notes) of the files with findings.
  for log in "$out"/*.log; do
    if grep -qE '^[^ :]+:[0-9]+:[0-9]+: (warning|error): ' "$log" &&
      ! is_deferred "$(basename "$log" .log | tr @ /)"; then
      cat "$log" >&2
    fi
  done
  echo "check_tidy: $(count "$failing") finding(s) in ${#checked[@]} files (${elapsed}s):" >&2
  printf '%s' "$failing" >&2
  echo "check_tidy: fix them (a check that is noise for this code base is turned off in" \
    ".clang-tidy, with its reason)" >&2
  exit 1
fi
echo "check_tidy: ${#checked[@]} files, no findings outside the deferred files (${elapsed}s," \
  "$("$tidy" --version | grep -m1 -o 'version [0-9.]*'))"
