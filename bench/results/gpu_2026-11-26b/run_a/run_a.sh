#!/usr/bin/env bash
# Device run A (2026-11-26, session 2): tests touched by the copy-lane change, GPU workers,
# and the memory comparison at an 80 GiB cap (an H100's capacity) on both sides.
set -uo pipefail
out="${1:?out dir}"
mkdir -p "$out"
xz -dc .gpu/staged.tar.xz | tar -C .gpu -xf -
export LD_LIBRARY_PATH="$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}" TESSERA_TEST_BIN_DIR="$PWD/.gpu/bin" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
free -g | tee -a "$out/device.txt"
for t in cuda_context_test cuda_kernels_test cuda_gpt2_test cuda_attention_test; do
  echo "== $t"; timeout 120 .gpu/bin/$t --gtest_brief=1 2>&1 | tee "$out/$t.txt" | tail -n 4
done
echo "== gpu_workers_test"
timeout 100 .gpu/bin/gpu_workers_test 2>&1 | tee "$out/gpu_workers_test.txt" | tail -n 15
run=(--preset gpt2-124m --seq-len 1024 --batch 16 --steps 20 --log-every 5 --data synthetic --seed 7 --device cuda)
for where in "" "--workers 1"; do
  echo "== train_gpt2 $where"
  timeout 60 .gpu/bin/train_gpt2 "${run[@]}" $where 2>&1 | tee -a "$out/workers_speed.txt" | tail -n 3
done
for s in /tmp/tessera/local_*; do [[ -d "$s" ]] && mkdir -p "$out/sessions/${s##*/}" && cp "$s"/*.log "$out/sessions/${s##*/}/"; done
echo "== tessera offload, 80 GiB cap, from 48x4096"
( time timeout 200 .gpu/bin/bench_gpt2_cuda --max-model --batch 1 --from-shape 9 --offload optimizer --gpu-memory-gib 80 ) 2>&1 | tee "$out/max_model_tessera_cap80gib.txt" | tail -n 12
free -g
echo "== torch, 80 GiB cap, from 40x3072"
( time timeout 100 python3 .gpu/torch_gpt2_cuda.py max-model --batch 1 --from-shape 5 --gpu-memory-gib 80 ) 2>&1 | tee "$out/max_model_torch_cap80gib.txt" | tail -n 6
