#!/usr/bin/env bash
# The 3D U-Net on the CPU, Tessera beside PyTorch eager (bench/torch_unet3d.py: the same network,
# parameter for parameter), same preset, patch, batch and thread count, the two alternated and
# repeated; prints each run's median step and the medians' ratio.
#
#   bench/unet3d_cpu_race.sh [PRESET] [VOLUME] [BATCH] [STEPS] [ROUNDS] [THREADS] [OUT] [DS]
# (DS=1: both with deep supervision, --deep-supervision)
#   bench/unet3d_cpu_race.sh nnunet 32 2 10 3 2 bench/results/unet3d_cpu_$(date +%F)
#
# Tessera: build/bin/train_unet3d (in this process, AdamW, generated volumes made ahead of each
# step); PyTorch: /usr/bin/python3 with Debian's python3-torch (scripts/install_deps.sh --bench),
# AdamW, random volumes. Each side's figure is its summary's median step time over STEPS steps
# (PyTorch after 3 warm-up steps; Tessera's median over all, the first step included).
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-nnunet} volume=${2:-32} batch=${3:-2} steps=${4:-10} rounds=${5:-3} threads=${6:-2}
out=${7:-bench/results/unet3d_cpu_$(date +%F)}
ds=()
[[ "${8:-0}" == 1 ]] && ds=(--deep-supervision)
mkdir -p "$out"
tessera=() torch=()
for round in $(seq "$rounds"); do
  # Alternate which side runs first.
  order=(tessera torch)
  ((round % 2 == 0)) && order=(torch tessera)
  for who in "${order[@]}"; do
    file="$out/${who}_r$round.txt"
    if [[ "$who" == tessera ]]; then
      build/bin/train_unet3d --preset "$preset" --volume "$volume" --batch "$batch" \
        --steps "$steps" --threads "$threads" --log-every "$steps" "${ds[@]}" >"$file" 2>&1
      ms=$(grep -o 'step_ms_median=[0-9.]*' "$file" | cut -d= -f2)
      tessera+=("$ms")
    else
      /usr/bin/python3 bench/torch_unet3d.py --preset "$preset" --volume "$volume" \
        --batch "$batch" --steps "$steps" --threads "$threads" --device cpu "${ds[@]}" >"$file" 2>&1
      ms=$(grep -o 'step_ms_median=[0-9.]*' "$file" | cut -d= -f2)
      torch+=("$ms")
    fi
    echo "round $round $who: step_ms_median=$ms"
  done
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
t=$(median "${tessera[@]}") p=$(median "${torch[@]}")
echo "summary: preset=$preset volume=$volume batch=$batch threads=$threads rounds=$rounds" \
  "deep_supervision=${8:-0}" \
  "tessera_step_ms=$t torch_step_ms=$p torch/tessera=$(awk -v a="$p" -v b="$t" 'BEGIN {printf "%.3f", a / b}')" |
  tee "$out/summary.txt"
