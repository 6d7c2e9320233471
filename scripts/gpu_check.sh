#!/usr/bin/env bash
# The GPU check, in two halves: build and stage here (a machine with CUDA's toolkit but no GPU),
# run on a lent GPU machine (CUDA, PyTorch 2.x, none of our Debian libraries, no network).
#
#   scripts/gpu_check.sh stage        builds the GPU tests and benchmarks (sm_90) into build/ and
#                                     copies them, with the shared libraries they need that a
#                                     CUDA machine lacks, into .gpu/ (git-ignored; < 64 MiB)
#   scripts/gpu_check.sh run [OUT]    on the GPU machine, from the repository root with .gpu/
#                                     carried: every gpu-labelled test, the GPT-2 124M loss check
#                                     against the CPU, the speed race with PyTorch (eager and
#                                     torch.compile) and the memory limits; raw outputs in OUT
#                                     (default bench/results/gpu_<date>), a summary last
#   scripts/gpu_check.sh run OUT tests|workers|check|speed|layers|memory|planner|unet|volume
#                                     one part only (planner, unet and volume, only by name: the
#                                     memory plan's activation budgets next to torch.compile's, and
#                                     parameter offload's largest model next to FSDP2 with CPU
#                                     offload; the nnU-Net-shaped U-Net's steps (bf16) next to
#                                     PyTorch's, fp32 and AMP; whole 256^3 volumes against AMP's
#                                     128^3 patches, and the largest cube each trains)
#
# Knobs (environment): SPEED_BATCHES (default "16 32"), SPEED_VOCABS (default "50257 50304"),
# SPEED_REPEATS (default 3: rounds of the speed race, its order rotated); CHECK_CPU=0 runs only the GPU side of
# the loss check (the CPU reference then comes from the same train_gpt2 command run elsewhere:
# it is fp32 and takes minutes per step); MAX_MODEL_FROM=K starts both model-size searches at
# shape K of their common list; MEMORY_SECONDS bounds each search (default 600); GPU_MEMORY_GIB
# caps both sides' GPU allocators in the memory part (an 80 GiB H100's capacity on an H200), and
# is what the volume part gives Tessera's planner (default 70: cuDNN's workspaces are not in its
# model yet); VOLUMES lists the cubes the volume part tries (default "256 320 352 384 448 512":
# the planner predicts 22.9 GiB at 256^3 keeping everything, 66.3 GiB at 512^3 recomputing, but
# cuDNN's 32-bit strides stop the top decoder's 64-channel input past 322^3 unless a
# convolution is split along D, which is not built: each side's first failure says which).
# Parts by name only: a rerun of one part fits the device time left.
set -euo pipefail
cd "$(dirname "$0")/.."

gpu_binaries=(cuda_device_test cuda_context_test nccl_communicator_test cuda_kernels_test
  cuda_attention_test cuda_volume_test cuda_gpt2_test gpu_workers_test bench_gpt2_cuda bench_cuda_layers train_gpt2
  train_unet3d tessera)

stage() {
  scripts/install_deps.sh >/dev/null
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DTESSERA_NATIVE=OFF >/dev/null
  cmake --build build-gpu -j "$(nproc)" --target "${gpu_binaries[@]}"
  rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib
  for binary in "${gpu_binaries[@]}"; do
    cp "build-gpu/bin/$binary" .gpu/bin/
    strip --strip-unneeded ".gpu/bin/$binary"
  done
  # Shared libraries the GPU machine lacks: everything ldd names but the C/C++ runtime and
  # CUDA's own libraries (which come with the machine's driver and toolkit).
  # (cuDNN is hundreds of MB: run() finds the one PyTorch's nvidia-cudnn package brings.)
  local skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libstdc\+\+|libgcc_s|libcuda\.|libcublas|libcudart|libnccl|libcudnn)'
  for binary in .gpu/bin/*; do
    ldd "$binary" | awk '$3 ~ /^\// {print $1, $3}'
  done | sort -u | while read -r name path; do
    if [[ ! "$name" =~ $skip ]]; then cp -L "$path" ".gpu/lib/$name"; fi
  done
  strip --strip-unneeded .gpu/lib/* 2>/dev/null || true
  cp bench/torch_gpt2_cuda.py bench/torch_unet3d.py .gpu/
  echo "gpu_check: staged $(ls .gpu/bin | wc -l) binaries and $(ls .gpu/lib | wc -l) libraries"
  # OpenBLAS alone is 36 MB: the carry limit (64 MiB) takes them packed.
  tar -C .gpu -cf - bin lib | xz -T0 -3 >.gpu/staged.tar.xz
  rm -rf .gpu/bin .gpu/lib
  du -sh .gpu
}

run() {
  local out="${1:-bench/results/gpu_$(date +%F)}" part="${2:-all}"
  mkdir -p "$out"
  if [[ -f .gpu/staged.tar.xz && ! -d .gpu/bin ]]; then xz -dc .gpu/staged.tar.xz | tar -C .gpu -xf -; fi
  export LD_LIBRARY_PATH="$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}"
  # cuDNN (the volume convolutions): PyTorch's nvidia-cudnn package, where the machine has it.
  local cudnn_lib
  cudnn_lib=$(python3 -c 'import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], "lib"))' 2>/dev/null || true)
  if [[ -n "$cudnn_lib" && -d "$cudnn_lib" ]]; then export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$cudnn_lib"; fi
  export PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
  if [[ "$part" == all || "$part" == tests ]]; then
    # The gpu-labelled tests (tests/CMakeLists.txt), each binary whole.
    # gpu_workers_test starts train_gpt2 and tessera (GPU worker processes) from .gpu/bin.
    export TESSERA_TEST_BIN_DIR="$PWD/.gpu/bin"
    for test in cuda_device_test cuda_context_test nccl_communicator_test cuda_kernels_test \
      cuda_attention_test cuda_volume_test cuda_gpt2_test; do
      echo "== $test"
      timeout 300 .gpu/bin/$test --gtest_brief=1 2>&1 | tee "$out/$test.txt" | tail -n 25 || true
    done
  fi
  if [[ "$part" == all || "$part" == workers ]]; then
    # GPU worker processes: the test alone (its failures print the workers' logs), then GPT-2
    # 124M through one GPU worker next to the driver's own GPU (what the worker path costs).
    export TESSERA_TEST_BIN_DIR="$PWD/.gpu/bin"
    echo "== gpu_workers_test"
    timeout 300 .gpu/bin/gpu_workers_test 2>&1 | tee "$out/gpu_workers_test.txt" | tail -n 25 || true
    local run=(--preset gpt2-124m --seq-len 1024 --batch 16 --steps 20 --log-every 5
      --data synthetic --seed 7 --device cuda)
    for where in "" "--workers 1"; do
      echo "== train_gpt2 ${run[*]} $where"
      # shellcheck disable=SC2086
      timeout 300 .gpu/bin/train_gpt2 "${run[@]}" $where 2>&1 | tee -a "$out/workers_speed.txt" |
        tail -n 1 || true
    done
    for session in "/tmp/tessera-$(id -un)"/local_*; do  # every local cluster's logs, for the record
      [[ -d "$session" ]] || continue
      mkdir -p "$out/sessions/${session##*/}" && cp "$session"/*.log "$out/sessions/${session##*/}/"
    done
  fi
  if [[ "$part" == all || "$part" == check ]]; then
    # GPT-2 124M, T=1024: 10 steps on the GPU against the same 10 steps on the CPU (fp32).
    echo "== gpt2-124m loss check"
    local common=(--preset gpt2-124m --seq-len 1024 --batch 8 --steps 10 --lr 3e-4 --log-every 1
      --data synthetic --seed 7)
    local cpu_pid=""
    if [[ "${CHECK_CPU:-1}" == 1 ]]; then
      timeout 540 .gpu/bin/train_gpt2 "${common[@]}" --threads 14 >"$out/check_cpu.txt" 2>&1 &
      cpu_pid=$!
    fi
    timeout 300 .gpu/bin/train_gpt2 "${common[@]}" --device cuda 2>&1 | tee "$out/check_gpu.txt" |
      tail -n 3 || true
    if [[ -n "$cpu_pid" ]]; then
      wait "$cpu_pid" || true
      tail -n 3 "$out/check_cpu.txt" || true
    fi
  fi
  if [[ "$part" == all || "$part" == speed ]]; then
    # Tessera, PyTorch eager and torch.compile on the same model, shapes, vocabulary and tokens,
    # at GPT-2's vocabulary and at it padded to 50304 (llm.c's and nanoGPT's), each repeated
    # SPEED_REPEATS times with the order of the three rotated every round (so none always runs
    # first on a cold or warm GPU); the summary takes medians.
    echo "== speed race: GPT-2 124M, T=1024"
    local runners=(tessera eager compile)
    for vocab in ${SPEED_VOCABS:-50257 50304}; do
      for batch in ${SPEED_BATCHES:-16 32}; do
        for ((round = 0; round < ${SPEED_REPEATS:-3}; ++round)); do
          for ((k = 0; k < 3; ++k)); do
            local runner="${runners[$(((round + k) % 3))]}"
            case "$runner" in
              tessera)
                timeout 300 .gpu/bin/bench_gpt2_cuda --batch "$batch" --vocab "$vocab" 2>&1 |
                  grep tessera_step | sed "s/^/round=$round /" | tee -a "$out/speed.txt" || true
                ;;
              eager)
                timeout 300 python3 .gpu/torch_gpt2_cuda.py speed --batch "$batch" \
                  --vocab "$vocab" 2>&1 | grep torch_step | sed "s/^/round=$round /" |
                  tee -a "$out/speed.txt" || true
                ;;
              compile)
                timeout 300 python3 .gpu/torch_gpt2_cuda.py speed --batch "$batch" \
                  --vocab "$vocab" --compile 2>&1 | grep torch_step | sed "s/^/round=$round /" |
                  tee -a "$out/speed.txt" || true
                ;;
            esac
          done
        done
      done
    done
  fi
  if [[ "$part" == all || "$part" == layers ]]; then
    echo "== where the step's GPU time goes (B=32, T=1024)"
    timeout 300 .gpu/bin/bench_cuda_layers --batch 32 2>&1 | tee "$out/layers.txt" || true
  fi
  if [[ "$part" == all || "$part" == memory ]]; then
    echo "== memory: largest batch, largest model"
    timeout 120 .gpu/bin/bench_gpt2_cuda --max-batch --batch 32 2>&1 |
      tee "$out/max_batch.txt" | tail -n 2 || true
    # Each try initialises its model on the host: the larger ones take minutes, so the searches
    # are bounded (MEMORY_SECONDS each) and report the largest that trained in that time.
    local cap="${GPU_MEMORY_GIB:-0}" suffix=""
    [[ "$cap" != 0 ]] && suffix="_cap${cap}gib"
    timeout "${MEMORY_SECONDS:-600}" .gpu/bin/bench_gpt2_cuda --max-model --batch 1 \
      --from-shape "${MAX_MODEL_FROM:-0}" --offload optimizer --gpu-memory-gib "$cap" 2>&1 |
      tee "$out/max_model_tessera$suffix.txt" | tail -n 3 || true
    timeout "${MEMORY_SECONDS:-600}" python3 .gpu/torch_gpt2_cuda.py max-model --batch 1 \
      --from-shape "${MAX_MODEL_FROM:-0}" --gpu-memory-gib "$cap" 2>&1 |
      tee "$out/max_model_torch$suffix.txt" | tail -n 2 || true
  fi
  if [[ "$part" == planner ]]; then  # minutes of its own: asked for by name, not in "all"
    # The memory plan on a real GPU (issue 25): GPT-2 124M and 350M at 100%, 50% and 25% of their
    # activations (train_gpt2 --activation-budget, planned on profiled layer times and the
    # measured host link) next to torch.compile with its activation memory budget at the same
    # share; then the largest GPT-2 trained with its parameters streamed from the host
    # (--offload parameters) next to PyTorch FSDP2 with CPU offload.
    echo "== planner: activation budgets, GPT-2 124M and 350M, B=8 T=1024"
    local shape layers channels heads budget
    for shape in "12 768 12" "24 1024 16"; do
      read -r layers channels heads <<<"$shape"
      for budget in 0 0.5 0.25; do
        local flags=()
        [[ "$budget" != 0 ]] && flags=(--activation-budget "$budget" --balance profile)
        timeout 300 .gpu/bin/train_gpt2 --layers "$layers" --channels "$channels" \
          --heads "$heads" --vocab 50257 --seq-len 1024 --batch 8 --steps 20 --log-every 20 \
          --data synthetic --seed 7 --device cuda --explain-memory "${flags[@]}" 2>&1 |
          grep -E "^summary|memory plan \(" | sed "s/^/tessera L=$layers budget=$budget: /" |
          tee -a "$out/planner_budgets.txt" || true
        flags=(--compile)
        [[ "$budget" != 0 ]] && flags+=(--activation-budget "$budget")
        timeout 300 python3 .gpu/torch_gpt2_cuda.py speed --layers "$layers" --channels \
          "$channels" --heads "$heads" --batch 8 "${flags[@]}" 2>&1 | grep torch_step |
          sed "s/^/torch L=$layers budget=$budget: /" | tee -a "$out/planner_budgets.txt" || true
      done
    done
    echo "== planner: the largest model with the parameters on the host"
    timeout "${MEMORY_SECONDS:-600}" .gpu/bin/bench_gpt2_cuda --max-model --batch 1 \
      --from-shape "${MAX_MODEL_FROM:-0}" --offload parameters 2>&1 |
      tee "$out/max_model_tessera_params.txt" | tail -n 3 || true
    timeout "${MEMORY_SECONDS:-600}" python3 .gpu/torch_gpt2_cuda.py max-model --batch 1 \
      --from-shape "${MAX_MODEL_FROM:-0}" --fsdp-cpu-offload 2>&1 |
      tee "$out/max_model_torch_fsdp_offload.txt" | tail -n 2 || true
  fi
  if [[ "$part" == unet ]]; then
    # The nnU-Net-shaped U-Net (31.2 M parameters) on 128^3 patches, batch 2: Tessera (bf16
    # activations, --device cuda's default; cuDNN convolutions) beside PyTorch eager in fp32 and
    # with bf16 AMP, the three alternated, two rounds.
    for round in 1 2; do
      for who in tessera torch_fp32 torch_amp; do
        case "$who" in
          tessera) timeout 600 .gpu/bin/train_unet3d --preset nnunet --device cuda --volume 128 \
            --batch 2 --steps 20 --log-every 10 2>&1 | tee "$out/unet_${who}_r$round.txt" | tail -n 3 || true ;;
          torch_fp32) timeout 600 python3 .gpu/torch_unet3d.py --preset nnunet --volume 128 \
            --batch 2 --steps 20 2>&1 | tee "$out/unet_${who}_r$round.txt" | tail -n 1 || true ;;
          torch_amp) timeout 600 python3 .gpu/torch_unet3d.py --preset nnunet --volume 128 \
            --batch 2 --steps 20 --amp 2>&1 | tee "$out/unet_${who}_r$round.txt" | tail -n 1 || true ;;
        esac
      done
    done
  fi
  if [[ "$part" == volume ]]; then
    # Issue 29's whole volumes on one GPU. (a) Whole 256^3 volumes, batch 1, Tessera in bf16 under
    # its memory planner, against PyTorch eager + AMP on 128^3 patches, batch 2 (voxels/s;
    # alternated, two rounds). (b) The largest cube each trains for two steps: Tessera (bf16,
    # the planner under GPU_MEMORY_GIB) against PyTorch eager + AMP + checkpointing per level +
    # save_on_cpu; each side stops at its first failure.
    local cap="${GPU_MEMORY_GIB:-70}"
    for round in 1 2; do
      timeout 300 .gpu/bin/train_unet3d --preset nnunet --device cuda --volume 256 --batch 1 \
        --steps 6 --log-every 1 --device-memory-gib "$cap" 2>&1 |
        tee "$out/volume_tessera_whole256_r$round.txt" | tail -n 2 || true
      timeout 300 python3 .gpu/torch_unet3d.py --preset nnunet --volume 128 --batch 2 --steps 6 \
        --amp 2>&1 | tee "$out/volume_torch_amp_patch128_r$round.txt" | tail -n 1 || true
    done
    local tessera_ok=1 torch_ok=1
    for v in ${VOLUMES:-256 320 352 384 448 512}; do
      if ((tessera_ok)); then
        timeout 300 .gpu/bin/train_unet3d --preset nnunet --device cuda --volume "$v" --batch 1 \
          --steps 2 --log-every 1 --device-memory-gib "$cap" >"$out/volume_tessera_$v.txt" 2>&1 ||
          tessera_ok=0
        echo "tessera $v^3: $( ((tessera_ok)) && echo trains || echo fails) $(tail -n 1 "$out/volume_tessera_$v.txt")"
      fi
      if ((torch_ok)); then
        timeout 300 python3 .gpu/torch_unet3d.py --preset nnunet --volume "$v" --batch 1 --steps 2 \
          --amp --checkpoint --save-on-cpu >"$out/volume_torch_$v.txt" 2>&1 || torch_ok=0
        echo "torch $v^3: $( ((torch_ok)) && echo trains || echo fails) $(tail -n 1 "$out/volume_torch_$v.txt")"
      fi
    done | tee "$out/volume_largest.txt"
  fi
  summarize "$out"
}

# The figures, one line each (what the closing note and docs/benchmarks.md quote).
summarize() {
  local out="$1"
  echo "== summary ($out)"
  for f in "$out"/cuda_*_test.txt "$out"/nccl_communicator_test.txt "$out"/gpu_workers_test.txt; do
    [[ -f "$f" ]] && echo "$(basename "$f" .txt): $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$f" |
      tr '\n' ' ')"
  done
  if [[ -f "$out/speed.txt" ]]; then
    # Per vocabulary, batch and runner: the medians over the rounds of tokens/s, both MFUs and the
    # timed steps' mean loss, and Tessera's speed over each PyTorch's.
    python3 - "$out/speed.txt" <<'PY'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    fields = dict(re.findall(r"(\w+)=('[^']*'|\S+)", line))
    if "tok_s" not in fields:
        continue
    runner = "tessera" if "tessera_step" in line else (
        "compile" if fields.get("compile") == "1" else "eager")
    key = (fields.get("vocab", "?"), fields["B"], runner)
    for name in ("tok_s", "mfu", "mfu_llmc", "loss_timed"):
        if name in fields:
            rows.setdefault(key + (name,), []).append(float(fields[name]))
def med(*key):
    values = rows.get(key)
    return statistics.median(values) if values else float("nan")
for vocab, batch in sorted({(k[0], k[1]) for k in rows}, key=lambda k: (k[0], int(k[1]))):
    t, e, c = (med(vocab, batch, r, "tok_s") for r in ("tessera", "eager", "compile"))
    n = len(rows.get((vocab, batch, "tessera", "tok_s"), []))
    print(f"vocab={vocab} B={batch} (median of {n}): tok_s tessera={t:.0f} torch={e:.0f} "
          f"torch_compile={c:.0f}; tessera/torch={t / e:.3f} tessera/compile={t / c:.3f}; "
          f"mfu (6N+12LCT) tessera={med(vocab, batch, 'tessera', 'mfu'):.4f} "
          f"compile={med(vocab, batch, 'compile', 'mfu'):.4f}; mfu_llmc (6N+6LCT) "
          f"tessera={med(vocab, batch, 'tessera', 'mfu_llmc'):.4f} "
          f"compile={med(vocab, batch, 'compile', 'mfu_llmc'):.4f}; loss_timed "
          f"tessera={med(vocab, batch, 'tessera', 'loss_timed'):.4f} "
          f"torch={med(vocab, batch, 'eager', 'loss_timed'):.4f} "
          f"compile={med(vocab, batch, 'compile', 'loss_timed'):.4f}")
PY
  fi
  if compgen -G "$out/volume_tessera_whole256_r*.txt" >/dev/null; then
    # voxels/s: Tessera's samples_per_s x 256^3 (whole volumes), PyTorch's own figure (patches).
    python3 - "$out" <<'PY'
import glob, re, statistics, sys
out = sys.argv[1]
def figures(pattern, key):
    values = []
    for path in sorted(glob.glob(f"{out}/{pattern}")):
        m = re.search(key + r"=([0-9.]+)", open(path).read())
        if m:
            values.append(float(m.group(1)))
    return values
whole = [s * 256 ** 3 for s in figures("volume_tessera_whole256_r*.txt", "samples_per_s")]
patches = figures("volume_torch_amp_patch128_r*.txt", "voxels_per_s")
if whole and patches:
    t, p = statistics.median(whole), statistics.median(patches)
    print(f"volume: tessera whole 256^3 b1 {t:.0f} voxels/s (median of {len(whole)}), torch amp "
          f"128^3 b2 {p:.0f} (median of {len(patches)}); ratio {t / p:.3f} (issue 29: >= 0.8)")
PY
  fi
  [[ -f "$out/volume_largest.txt" ]] && cat "$out/volume_largest.txt"
  if [[ -f "$out/planner_budgets.txt" ]]; then
    grep -E "^tessera .*summary|^torch " "$out/planner_budgets.txt" |
      sed -E 's/(tessera|torch) (L=[0-9]+ budget=[0-9.]+):.*(tokens_per_s|tok_s)=([0-9]+).*/\1 \2 tok_s=\4/'
  fi
  return 0
}

case "${1:-}" in
  stage) stage ;;
  run) shift; run "$@" ;;
  *)
    sed -n '2,17p' "$0"
    exit 2
    ;;
esac
