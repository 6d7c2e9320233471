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
