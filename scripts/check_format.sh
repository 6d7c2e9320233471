#!/usr/bin/env bash
# Checks that every C++/CUDA source tracked by git is formatted by clang-format (.clang-format).
# Changes nothing; lists the files to fix and how.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || { echo "check_format: clang-format is not installed" >&2; exit 1; }
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
unformatted=()
for file in "${files[@]}"; do
  if ! clang-format --dry-run --Werror "$file" >/dev/null 2>&1; then unformatted+=("$file"); fi
done
if [[ ${#unformatted[@]} -gt 0 ]]; then
  echo "check_format: ${#unformatted[@]} file(s) are not clang-formatted:" >&2
  printf '  %s\n' "${unformatted[@]}" >&2
  echo "fix with: clang-format -i ${unformatted[*]}" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files clang-formatted ($(clang-format --version | head -n 1))"
