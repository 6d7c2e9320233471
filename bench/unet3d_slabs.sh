#!/usr/bin/env bash
# Spatial parallelism (train_unet3d --spatial-parallel S): the largest cubic volume the small
# U-Net (batch 1) trains under a per-worker host cap on one worker (the memory planner
# recomputing what it must) against S slabs over S workers, and the per-worker peak and step time
# of each at the volumes that fit. Each run trains a few steps on a local cluster and prints the
# predicted and measured per-worker peaks; a volume that does not fit is refused by the planner
# with its floor. Raw output of every run goes to OUT_DIR.
#
#   bench/unet3d_slabs.sh [OUT_DIR] [CAP_GIB] [STEPS]
set -euo pipefail
out=${1:-bench/results/unet3d_slabs_$(date +%F)}
cap=${2:-0.1}
steps=${3:-1}
bin=${TESSERA_BIN_DIR:-build/bin}
mkdir -p "$out"
run() {  # name, volume, flags...
  local name=$1 volume=$2
  shift 2
  local log="$out/${name}_v${volume}.txt"
  if "$bin/train_unet3d" --preset small --volume "$volume" --batch 1 --steps "$steps" \
      --host-memory-gib "$cap" --explain-memory "$@" >"$log" 2>&1; then
    local peak step
    peak=$(grep -m1 -o "host tier: peak [0-9.]* MiB" "$log" | grep -o "[0-9.]* MiB")
    step=$(grep -o "step_ms_median=[0-9.]*" "$log" | cut -d= -f2)
    local measured
    measured=$(grep -o "peak_mb=[0-9.]*" "$log" | cut -d= -f2)
    printf '%-10s %4s^3  fits   predicted %-11s measured %7s MB  step %8s ms\n' "$name" "$volume" \
      "$peak" "${measured:-?}" "$step"
  else
    printf '%-10s %4s^3  refused: %s\n' "$name" "$volume" \
      "$(grep -m1 -o 'needs to be at least [0-9.]* MiB' "$log" || tail -1 "$log")"
  fi
}
echo "small U-Net, batch 1, host cap ${cap} GiB per worker, ${steps} steps, $(nproc) cores"
for v in 56 60 64; do run "1 worker" "$v" --workers 1; done
for v in 64 80 96; do run "4 slabs" "$v" --workers 4 --spatial-parallel 4; done
for v in 48 64; do run "2 slabs" "$v" --workers 2 --spatial-parallel 2; done

# The base-4 U-Net (--preset tiny: base 4, depth 1): plain execution (every activation kept, no
# cap, its predicted peak against the cap), the memory planner on one worker, and 4 slabs with
# the planner, under the same per-worker cap; then the largest 4-slab volume trained beside the
# uncapped one-worker run of it (the same losses).
echo "base-4 U-Net (--preset tiny), batch 1, cap ${cap} GiB per worker"
plain() {  # volume: one worker, uncapped, the predicted peak
  "$bin/train_unet3d" --preset tiny --volume "$1" --batch 1 --steps 0 --workers 1 --explain-memory \
    >"$out/tiny_plain_v$1.txt" 2>&1
  printf 'plain      %4s^3  predicted %s (cap %s GiB)\n' "$1" \
    "$(grep -m1 -o 'host tier: peak [0-9.]* MiB' "$out/tiny_plain_v$1.txt" | grep -o '[0-9.]* MiB')" "$cap"
}
planned() {  # name, volume, flags...: under the cap, planned (no step)
  local name=$1 volume=$2
  shift 2
  "$bin/train_unet3d" --preset tiny --volume "$volume" --batch 1 --steps 0 --host-memory-gib "$cap" \
    --explain-memory "$@" >"$out/tiny_${name// /_}_v$volume.txt" 2>&1 || true
  printf '%-10s %4s^3  %s\n' "$name" "$volume" \
    "$(grep -m1 -o -E 'host tier: peak [0-9.]* MiB|needs to be at least [0-9.]* MiB' \
      "$out/tiny_${name// /_}_v$volume.txt")"
}
for v in 64 66; do plain "$v"; done
for v in 78 80; do planned "planner" "$v" --workers 1; done
for v in 112 120; do planned "4 slabs" "$v" --workers 4 --spatial-parallel 4; done
"$bin/train_unet3d" --preset tiny --volume 112 --batch 1 --steps "$steps" --workers 1 \
  >"$out/tiny_uncapped_v112_train.txt" 2>&1
"$bin/train_unet3d" --preset tiny --volume 112 --batch 1 --steps "$steps" --workers 4 \
  --spatial-parallel 4 --host-memory-gib "$cap" >"$out/tiny_slabs_v112_train.txt" 2>&1
for f in uncapped slabs; do
  printf '112^3 %-9s %s\n' "$f" "$(grep -o 'final_loss=[0-9.]* peak_mb=[0-9.]*' \
    "$out/tiny_${f}_v112_train.txt")"
done
