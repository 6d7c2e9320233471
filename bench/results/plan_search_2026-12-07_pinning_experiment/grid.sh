#!/usr/bin/env bash
# usage: grid.sh OUTDIR
cd /work/main
TESSERA_BIN_DIR=$PWD/build/bin /tmp/bench_copy --models gpt2 unet3d --caps 0 --steps 7 \
  --warmup 2 --rounds 5 --calibration-rounds 5 --plans "D2 x P2 1f1b M2 ZeRO-0" \
  "D2 x P2 interleaved V2 M2 ZeRO-3" "D1 x T2 x P2 gpipe M1" "D2 x T2 SP x P1 M1 ZeRO-0" \
  "D2 x T2 x P1 M2 ZeRO-1" "D4 x P1 M1 ZeRO-3" "D1 x T2 x P2 zb-h1 M16" "D1 x T4 SP x P1 M16" \
  "D4 x P1 M1 ZeRO-2" "D2 x T2 x P1 M1 ZeRO-3" "D1 x S2 x P2 zb-h1 M2 ZeRO-2" \
  "D1 x S4 x P1 M8 ZeRO-3" "D1 x P4 gpipe M4" "D2 x P2 1f1b M2 cut 3+4 ZeRO-0" \
  "D1 x P4 1f1b M8" "D1 x S2 x P2 gpipe M8 ZeRO-1" --out "$1" "${@:2}" > "$1.txt" 2>&1
