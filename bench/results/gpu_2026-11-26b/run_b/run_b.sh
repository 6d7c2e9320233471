#!/usr/bin/env bash
# Device run B (2026-11-26, session 2): GPU workers after the collective-kernel fix; the memory
# comparison (ZeRO-3 + optimizer offload vs plain PyTorch + AdamW) at an 80 GiB cap (an H100's
# capacity) and on the whole H200.
set -uo pipefail
out="${1:?out dir}"
mkdir -p "$out"
xz -dc .gpu/staged.tar.xz | tar -C .gpu -xf -
export LD_LIBRARY_PATH="$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}" TESSERA_TEST_BIN_DIR="$PWD/.gpu/bin" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
free -g | tee -a "$out/device.txt"
echo "== gpu_workers_test"
timeout 100 .gpu/bin/gpu_workers_test 2>&1 | tee "$out/gpu_workers_test.txt" | grep -E "^\[ +(OK|FAILED|PASSED) |error" | head -20
echo "== tessera offload, 80 GiB cap, from 44x4096"
( time timeout 270 .gpu/bin/bench_gpt2_cuda --max-model --batch 1 --from-shape 8 --offload optimizer --gpu-memory-gib 80 ) 2>&1 | tee "$out/max_model_tessera_cap80gib.txt" | tail -n 14
if ! grep -q "try layers=48 channels=4096: ok" "$out/max_model_tessera_cap80gib.txt"; then
  echo "== tessera offload 48x4096 on the whole H200"
  ( time timeout 150 .gpu/bin/bench_gpt2_cuda --layers 48 --channels 4096 --heads 32 --batch 1 --steps 1 --warmup 1 --offload optimizer ) 2>&1 | tee "$out/model_48x4096_tessera.txt" | tail -n 8
fi
echo "== torch, whole H200, from 44x4096"
( time timeout 100 python3 .gpu/torch_gpt2_cuda.py max-model --batch 1 --from-shape 8 ) 2>&1 | tee "$out/max_model_torch.txt" | tail -n 5
