#!/usr/bin/env bash
# Device run D: the memory comparison on a real H100 (80 GB), if one is lent.
set -uo pipefail
out="${1:?out dir}"; mkdir -p "$out"
xz -dc .gpu/staged.tar.xz | tar -C .gpu -xf -
export LD_LIBRARY_PATH="$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
free -g | tee -a "$out/device.txt"
echo "== tessera offload, from 44x4096"
( time timeout 200 .gpu/bin/bench_gpt2_cuda --max-model --batch 1 --from-shape 8 --offload optimizer ) 2>&1 | tee "$out/max_model_tessera.txt" | tail -n 12
echo "== torch, from 40x3072"
( time timeout 90 python3 .gpu/torch_gpt2_cuda.py max-model --batch 1 --from-shape 5 ) 2>&1 | tee "$out/max_model_torch.txt" | tail -n 5
