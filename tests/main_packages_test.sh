#!/usr/bin/env bash
# The README's first command (scripts/train.sh) installs only `scripts/install_deps.sh --main`'s
# packages, apt-get --no-install-recommends, on a fresh Debian 12. Every other test runs after
# the full set, so a package only the full set pulls in breaks the first command alone, and
# nothing else notices (zlib1g-dev did: CMake stopped at "Could NOT find ZLIB").
#
# This checks, on this machine's dpkg database, that the --main set covers what the main job's
# build reads: every system header the objects of `tessera` and `train_gpt2` include (the build's
# dependency records) and every library their link lines name belong to a package of the set or
# to one of their dependencies (Depends and Pre-Depends, followed to the end, as apt installs
# them). Files under /usr/local (CUDA, built only with a GPU) are not Debian's and not checked.
#
# Usage: tests/main_packages_test.sh BUILD_DIR   (built; CTest: main_packages)
# Exits 77 (skipped) without dpkg or ninja, 1 naming each file and the package to add.
set -euo pipefail
source_dir=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${1:?usage: $0 BUILD_DIR}
for tool in dpkg-query dpkg ninja; do
  command -v "$tool" >/dev/null || { echo "main_packages: SKIPPED: no $tool here"; exit 77; }
done
for binary in bin/tessera bin/train_gpt2; do
  [[ -f "$build_dir/$binary" ]] || { echo "main_packages: build $build_dir/$binary first" >&2; exit 1; }
done

# The closure: the --main packages and everything they depend on. Installed packages' fields
# come from one dpkg-query; a virtual package (an alternative such as libc-dev) counts as every
# installed package that provides it.
declare -A depends provides closure
while IFS=$'\t' read -r package status dependencies provided; do
  [[ "$status" == "install ok installed" ]] || continue
  depends[$package]=$dependencies
  IFS=',' read -ra virtuals <<< "$provided"
  for virtual in "${virtuals[@]}"; do
    virtual=${virtual%%(*}
    virtual=${virtual// /}
    [[ -n "$virtual" ]] && provides[$virtual]+=" $package"
  done
done < <(dpkg-query -W -f='${Package}\t${Status}\t${Depends}, ${Pre-Depends}\t${Provides}\n')

mapfile -t wanted < <("$source_dir/scripts/install_deps.sh" --main --list)
queue=()
for package in "${wanted[@]}"; do
  [[ -v "depends[$package]" ]] ||
    { echo "main_packages: SKIPPED: $package (install_deps.sh --main) is not installed here"; exit 77; }
  queue+=("$package")
done
while [[ ${#queue[@]} -gt 0 ]]; do
  package=${queue[-1]}
  unset 'queue[-1]'
  [[ -v "closure[$package]" ]] && continue
  closure[$package]=1
  IFS=',|' read -ra alternatives <<< "${depends[$package]}"
  for alternative in "${alternatives[@]}"; do
    alternative=${alternative%%(*}  # "libc6 (>= 2.34)"
    alternative=${alternative// /}
    alternative=${alternative%%:*}  # "python3:any"
    [[ -z "$alternative" ]] && continue
    if [[ -v "depends[$alternative]" ]]; then
      queue+=("$alternative")
    elif [[ -v "provides[$alternative]" ]]; then
      read -ra providers <<< "${provides[$alternative]}"
      queue+=("${providers[@]}")
    fi
  done
done

# What the build reads: system headers from the dependency records of both binaries' objects,
# libraries from their link lines (paths, and -l names resolved as the compiler resolves them).
mapfile -t objects < <(ninja -C "$build_dir" -t inputs bin/tessera bin/train_gpt2 | grep '\.o$' | sort -u)
declare -A files
while read -r path; do
  files[$path]=1
done < <(ninja -C "$build_dir" -t deps "${objects[@]}" | sed -n 's/^    //p' |
  grep '^/usr/' | grep -v '^/usr/local/' | sort -u | xargs -r realpath -s -m | sort -u)
for binary in bin/tessera bin/train_gpt2; do
  for word in $(ninja -C "$build_dir" -t commands "$binary" | tail -n 1); do
    case "$word" in
      /usr/local/*) ;;
      /usr/*.so* | /usr/*.a) files[$(realpath -s -m "$word")]=1 ;;
      -l*)
        for suffix in so a; do
          found=$(c++ -print-file-name="lib${word#-l}.$suffix")
          if [[ "$found" == /* ]]; then
            files[$(realpath -s -m "$found")]=1
            break
          fi
        done
        ;;
    esac
  done
done
echo "main_packages: ${#wanted[@]} packages (${#closure[@]} with their dependencies), ${#files[@]} system files the main build reads"
[[ ${#files[@]} -gt 100 ]] || { echo "main_packages: FAILED: only ${#files[@]} files found in $build_dir's records" >&2; exit 1; }

# Each file's owner (dpkg -S; a merged-/usr system may list it under /lib instead of /usr/lib).
declare -A owners
while IFS= read -r line; do
  [[ "$line" == diversion* ]] && continue
  path=${line##*: }
  list=${line%: *}
  owners[$path]=$list
done < <(dpkg -S "${!files[@]}" 2>/dev/null || true)
failures=0
for path in "${!files[@]}"; do
  list=${owners[$path]:-}
  if [[ -z "$list" && "$path" == /usr/lib/* ]]; then
    list=$(dpkg -S "${path#/usr}" 2>/dev/null | sed 's/: [^:]*$//' | head -n 1 || true)
  fi
  if [[ -z "$list" ]]; then
    echo "main_packages: $path belongs to no Debian package (installed by hand? the first command cannot have it)"
    failures=$((failures + 1))
    continue
  fi
  covered=0
  IFS=',' read -ra candidates <<< "$list"
  for candidate in "${candidates[@]}"; do
    candidate=${candidate// /}
    candidate=${candidate%%:*}
    [[ -v "closure[$candidate]" ]] && covered=1
  done
  if [[ $covered -eq 0 ]]; then
    echo "main_packages: $path (package ${list// /}) is read by the main build, but no package of" \
      "install_deps.sh --main depends on it: add it to that list"
    failures=$((failures + 1))
  fi
done
if [[ $failures -gt 0 ]]; then
  echo "main_packages: FAILED: $failures file(s) outside the first command's packages" >&2
  exit 1
fi
echo "main_packages: OK"
