#!/usr/bin/env bash
# Checks the installable SDK end to end (CTest runs it as `sdk_install`, label integration):
#   1. installs the build into a temporary prefix (`cmake --install BUILD --prefix P`);
#   2. compiles every installed header on its own against P (a public header that needs an
#      internal one, which is not installed, fails here; X-macro lists are compiled through the
#      header that includes them);
#   3. configures examples/out_of_tree with nothing but -DCMAKE_PREFIX_PATH=P, builds it, and
#      runs it: a local cluster of 2 workers trains a few steps, started from P/bin/tessera
#      although neither PATH nor TESSERA_BIN_DIR names it;
#   4. runs it with TESSERA_BIN_DIR pointing nowhere and checks the error names the place;
#   5. builds every other example the same way, each on its own and beside it before anything
#      runs (examples/mlp, gpt2, unet3d and the plugin examples/plugin), and runs them briefly: train_mlp with the plugin's op as its
#      activation on a local cluster (the workers load the plugin the driver sends), train_gpt2
#      on the text installed with the SDK, train_unet3d in process.
# Usage: scripts/test_install.sh [BUILD_DIR]   (default: build; it must be built already)
set -euo pipefail
source_dir=$(cd "$(dirname "$0")/.." && pwd)
build_dir=$(cd "${1:-$source_dir/build}" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/tessera_sdk_install.XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
generator=()
command -v ninja > /dev/null && generator=(-G Ninja)
# Two compile jobs: CTest reserves two processors for this test (tests/CMakeLists.txt), so it
# does not starve the timing-sensitive tests running beside it.
export CMAKE_BUILD_PARALLEL_LEVEL=2
# Only the install may tell the example where Tessera is.
unset TESSERA_BINARY TESSERA_BIN_DIR CMAKE_PREFIX_PATH Tessera_DIR
PATH=$(printf '%s' "$PATH" | tr ':' '\n' | grep -vxF "$build_dir/bin" | paste -sd: -)
export PATH

fail() {
  echo "test_install: FAILED: $*" >&2
  exit 1
}

echo "== install into $prefix"
cmake --install "$build_dir" --prefix "$prefix" > "$work/install.log" ||
  { cat "$work/install.log"; fail "cmake --install"; }
for file in bin/tessera lib/cmake/Tessera/TesseraConfig.cmake \
  lib/cmake/Tessera/TesseraConfigVersion.cmake lib/cmake/Tessera/TesseraTargets.cmake \
  lib/libtessera_training.a lib/libtessera_client.a include/tessera/client/cluster.h \
  include/tessera/core/status.h; do
  [[ -e "$prefix/$file" ]] || fail "the install has no $file"
done
for internal in launcher/session.h core/rpc/connection.h scheduler/scheduler_core.h; do
  [[ ! -e "$prefix/include/tessera/$internal" ]] || fail "internal header $internal was installed"
done

echo "== every installed header compiles on its own"
mkdir -p "$work/headers"
(
  cd "$prefix/include/tessera"
  # Headers meant to be included on their own (not X-macro lists such as settings_def.h).
  grep -rl --include='*.h' '^#pragma once' . | sed 's|^\./||' | sort
) > "$work/headers/list"
{
  echo 'cmake_minimum_required(VERSION 3.25)'
  echo 'project(tessera_headers LANGUAGES CXX)'
  echo 'set(CMAKE_CXX_STANDARD 20)'
  echo 'find_package(Tessera REQUIRED)'
  echo 'add_library(headers OBJECT)'
  echo 'target_link_libraries(headers PRIVATE Tessera::tessera)'
  i=0
  while read -r header; do
    i=$((i + 1))
    printf '#include "%s"\n' "$header" > "$work/headers/h$i.cc"
    echo "target_sources(headers PRIVATE h$i.cc)"
  done < "$work/headers/list"
} > "$work/headers/CMakeLists.txt"
echo "$(wc -l < "$work/headers/list") headers"
cmake -S "$work/headers" -B "$work/headers/build" "${generator[@]}" \
  -DCMAKE_PREFIX_PATH="$prefix" > "$work/headers.log" 2>&1 ||
  { cat "$work/headers.log"; fail "configuring the header check"; }
cmake --build "$work/headers/build" --target headers > "$work/headers.log" 2>&1 ||
  { cat "$work/headers.log"; fail "a public header does not compile on its own"; }

# Every example directory with a CMakeLists.txt of its own builds against the install alone, each
# in a build directory of its own. Most have one source, so one compile job each, in two lanes at
# once (the two processors CTest reserves), the longest builds first: about half the wall time of
# one after the other. A lane records each example's outcome; failures are reported in order.
build_example() {
  local example=$1
  if ! cmake -S "$source_dir/examples/$example" -B "$work/$example" "${generator[@]}" \
    -DCMAKE_PREFIX_PATH="$prefix" > "$work/$example.log" 2>&1; then
    echo "configuring" > "$work/$example.failed"
  elif ! cmake --build "$work/$example" --parallel 1 >> "$work/$example.log" 2>&1; then
    echo "building" > "$work/$example.failed"
  fi
}
lanes=("gpt2 out_of_tree plugin" "unet3d mlp")
lane_pids=()
for lane in "${lanes[@]}"; do
  echo "== configure and build examples/{${lane// /,}} (one lane)"
  (for example in $lane; do build_example "$example"; done) &
  lane_pids+=($!)
done
for pid in "${lane_pids[@]}"; do wait "$pid"; done
for example in ${lanes[*]}; do
  if [[ -f "$work/$example.failed" ]]; then
    cat "$work/$example.log"
    fail "$(cat "$work/$example.failed") examples/$example"
  fi
done

echo "== run examples/out_of_tree"
"$work/out_of_tree/my_driver" 3 > "$work/run.log" 2>&1 || { cat "$work/run.log"; fail "my_driver"; }
cat "$work/run.log"
grep -q '^step 3 loss ' "$work/run.log" || fail "my_driver did not print step 3's loss"
grep -qxF "scheduler: $prefix/bin/tessera" "$work/run.log" ||
  fail "the cluster was not started from $prefix/bin/tessera"

echo "== a wrong TESSERA_BIN_DIR is reported"
if TESSERA_BIN_DIR=$work/nowhere "$work/out_of_tree/my_driver" 1 > "$work/wrong.log" 2>&1; then
  fail "my_driver ran with TESSERA_BIN_DIR=$work/nowhere"
fi
cat "$work/wrong.log"
grep -q "TESSERA_BIN_DIR.*$work/nowhere/tessera" "$work/wrong.log" ||
  fail "the error does not name \$TESSERA_BIN_DIR and $work/nowhere/tessera"

echo "== train_mlp with the plugin's softsign on a local cluster"
"$work/mlp/train_mlp" --plugin "$work/plugin/libmy_ops.so" --activation softsign_forward \
  --temp-dir "$work/sessions" > "$work/mlp_run.log" 2>&1 ||
  { cat "$work/mlp_run.log"; fail "train_mlp --plugin"; }
cat "$work/mlp_run.log"
grep -q "loaded plugin 'my_ops'" "$work/mlp_run.log" || fail "train_mlp did not load the plugin"
grep -q '^step 100 loss ' "$work/mlp_run.log" || fail "train_mlp did not reach step 100"
ls "$work/sessions/plugins/"*-my_ops.so > /dev/null 2>&1 ||
  fail "no worker wrote the plugin it was sent under $work/sessions/plugins"

echo "== train_gpt2 (the text installed with the SDK) and train_unet3d, two steps each"
"$work/gpt2/train_gpt2" --preset tiny --steps 2 > "$work/gpt2_run.log" 2>&1 ||
  { cat "$work/gpt2_run.log"; fail "train_gpt2"; }
tail -n 3 "$work/gpt2_run.log"
grep -q "$prefix/share/tessera/data/tinyshakespeare.txt" "$work/gpt2_run.log" ||
  fail "train_gpt2 did not read the text installed under $prefix/share/tessera/data"
"$work/unet3d/train_unet3d" --preset tiny --steps 2 > "$work/unet3d_run.log" 2>&1 ||
  { cat "$work/unet3d_run.log"; fail "train_unet3d"; }
tail -n 3 "$work/unet3d_run.log"
echo "test_install: OK"
