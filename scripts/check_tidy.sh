#!/usr/bin/env bash
# Runs clang-tidy (the checks in .clang-tidy, Clang's thread-safety analysis among them) on the
# C++ sources tracked by git (not CUDA .cu), in parallel, with the compile database of a build.
# Every finding is an error.
#   scripts/check_tidy.sh                  the sources that may have changed since the baseline
#                                          (below); findings fail (deferred files: below)
#   scripts/check_tidy.sh --all            every source
#   scripts/check_tidy.sh --all --record   every source, and when clean and the working tree
#                                          is committed, HEAD becomes the baseline
#   scripts/check_tidy.sh --record         what changed since the baseline, and when clean and
#                                          the working tree is committed, HEAD becomes the
#                                          baseline (every other source is unchanged, with
#                                          unchanged includes, since it was found clean)
#   scripts/check_tidy.sh --report [...]   also list every deferred file's findings in full
#   scripts/check_tidy.sh FILE...          only these files (paths from the repository root)
# The baseline (scripts/tidy_baseline) is a commit at which every source was checked and clean.
# Since then only sources that changed, or include a file that changed (the build's dependency
# records), can have new findings, so only they are checked: a minute instead of half an hour of
# two cores. scripts/tidy_changed.py picks them, and falls back to every source when it cannot
# narrow the set (no baseline in the clone, no build yet, the checks themselves changed).
# The dependency records come from build/ (TESSERA_TIDY_BUILD_DIR to change it); the compile
# commands from build-tidy/ (TESSERA_TIDY_DATABASE_DIR), configured here when needed.
# TESSERA_TIDY_JOBS: how many clang-tidy processes at once (default: one per processor).
#
# Deferred: files that other branches are restructuring have their findings counted and printed
# but do not fail the check until those branches land. Take a file off the list once fixed.
set -euo pipefail
cd "$(dirname "$0")/.."
deferred=(
)
report=0
all=0
record=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --report) report=1 ;;
    --all) all=1 ;;
    --record) record=1 ;;
    -*) echo "check_tidy: unknown option $1 (see the top of $0)" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
if [[ $record -eq 1 && $# -gt 0 ]]; then
  echo "check_tidy: --record takes no files (the baseline is a tree checked whole)" >&2
  exit 2
fi
if [[ $record -eq 1 && -n "$(git status --porcelain --untracked-files=normal)" ]]; then
  echo "check_tidy: --record needs a committed working tree (commit, then run again)" >&2
  exit 2
fi

# Clang 15's (scripts/install_deps.sh says why not Debian's default); TESSERA_CLANG_TIDY names
# another.
tidy=${TESSERA_CLANG_TIDY:-clang-tidy-15}
command -v "$tidy" >/dev/null || {
  echo "check_tidy: $tidy is not installed (scripts/install_deps.sh installs it)" >&2
  exit 1
}
build=${TESSERA_TIDY_BUILD_DIR:-build}
# clang-tidy needs a compile command per source, which a unity build (TESSERA_UNITY, the
# default) does not have: build-tidy/ is configured with the same options but without it, and
# only its generated headers (the Cap'n Proto schema) are built. build/'s dependency records
# pick the sources to check (scripts/tidy_changed.py).
database=${TESSERA_TIDY_DATABASE_DIR:-build-tidy}
if [[ ! -f "$database/compile_commands.json" ]]; then
  cmake -S . -B "$database" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_UNITY=OFF >/dev/null
fi
mapfile -t generated < <(ninja -C "$database" -t targets all |
  sed -n 's|^\(generated/[^:]*\.h\): .*|\1|p')
[[ ${#generated[@]} -eq 0 ]] || ninja -C "$database" "${generated[@]}" >/dev/null

scope="every source"
if [[ $# -gt 0 ]]; then
  files=("$@")
  scope="the files named"
elif [[ $all -eq 1 ]]; then
  mapfile -t files < <(git ls-files '*.cc')
else
  baseline=$(grep -m1 -o '^[0-9a-f]\{40\}' scripts/tidy_baseline 2>/dev/null || true)
  if [[ -z "$baseline" ]]; then
    selection=$'ALL\nscripts/tidy_baseline names no commit'
  else
    if [[ $record -eq 1 ]] && ! ninja -C "$build" -n 2>/dev/null | grep -q 'no work to do'; then
      # Its dependency records pick what to check: they must be the tree's.
      echo "check_tidy: --record needs $build built from this tree (build it, then run again)" >&2
      exit 2
    fi
    selection=$(python3 scripts/tidy_changed.py "$build" "$baseline")
  fi
  if [[ "$(head -n1 <<< "$selection")" == ALL ]]; then
    echo "check_tidy: checking every source: $(sed -n 2p <<< "$selection")"
    mapfile -t files < <(git ls-files '*.cc')
  else
    mapfile -t files < <(grep . <<< "$selection" || true)
    scope="what changed since ${baseline:0:12} (scripts/tidy_baseline)"
    if [[ ${#files[@]} -eq 0 ]]; then
      echo "check_tidy: no source changed since ${baseline:0:12} (scripts/tidy_baseline)"
      [[ $record -eq 1 ]] || exit 0
    fi
  fi
fi
echo "check_tidy: ${#files[@]} source(s), $scope"
# Sources without a compile command (built elsewhere, e.g. examples/out_of_tree against the
# installed SDK) cannot be checked.
mapfile -t known < <(python3 -c 'import json, os, sys
for entry in json.load(open(sys.argv[1])):
    print(os.path.relpath(os.path.join(entry["directory"], entry["file"])))' \
  "$database/compile_commands.json")
declare -A in_database=()
for file in "${known[@]}"; do in_database[$file]=1; done
checked=()
for file in "${files[@]}"; do
  if [[ -n "${in_database[$file]:-}" ]]; then
    checked+=("$file")
  else
    echo "check_tidy: skipped $file (no compile command in $database)"
  fi
done

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
started=$(date +%s)
# One clang-tidy per file; its findings go to a file of its own. Exit codes are not used: a file
# that does not parse prints errors, which count too. -Wno-error: a -Werror build's compiler
# warnings are the compiler's to report (the checks in .clang-tidy are tidy's).
[[ ${#checked[@]} -eq 0 ]] || printf '%s\n' "${checked[@]}" | xargs -P "${TESSERA_TIDY_JOBS:-$(nproc)}" -I{} sh -c \
  '"$4" -p "$1" --quiet --extra-arg=-Wno-error "$2" > "$3/$(echo "$2" | tr / @).log" 2>&1 || true' \
  _ "$database" {} "$out" "$tidy"

# A finding is "path:line:col: warning|error: text [check]"; one in a header is reported by
# every file that includes it, so each is counted once.
findings=$(cat /dev/null "$out"/*.log 2>/dev/null | grep -E '^[^ :]+:[0-9]+:[0-9]+: (warning|error): ' |
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
if [[ $record -eq 1 ]]; then
  if [[ -n "$deferred_found" ]]; then
    echo "check_tidy: not recorded: deferred files still have findings" >&2
    exit 1
  fi
  if [[ -n "$(git status --porcelain --untracked-files=normal)" ]]; then
    echo "check_tidy: not recorded: the working tree has changes (commit, then run again)" >&2
    exit 1
  fi
  head=$(git rev-parse HEAD)
  tmp=$(mktemp scripts/.tidy_baseline.XXXXXX)
  printf '%s\n%s\n' "$head" \
    "# Every source was clang-tidy clean here (scripts/check_tidy.sh --record)." > "$tmp"
  sync "$tmp"
  mv "$tmp" scripts/tidy_baseline
  echo "check_tidy: baseline is now ${head:0:12}; commit scripts/tidy_baseline"
fi
