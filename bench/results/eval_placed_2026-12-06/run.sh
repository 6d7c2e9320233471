#!/usr/bin/env bash
# Validation on the training placement (this commit) against the whole model gathered onto one
# worker (82f36bc's train_gpt2 and tessera, built in /tmp/x/old): GPT-2 small preset (10.8M
# parameters), ZeRO-3 on two workers, 20 steps, the validation loss every 5 steps (8 batches),
# each binary with and without validation, alternated, three rounds; wall seconds per run.
set -euo pipefail
out=$(dirname "$0")
args="--preset small --workers 2 --zero-stage 3 --steps 20 --log-every 10 --eval-batches 8"
for round in 1 2 3; do
  for v in old new; do
    bin=$([ $v = old ] && echo /tmp/x/old/build/bin || echo build/bin)
    for eval in 0 5; do
      start=$(date +%s.%N)
      "$bin/train_gpt2" $args --eval-every $eval > "$out/${v}_eval${eval}_r$round.txt" 2>&1
      end=$(date +%s.%N)
      echo "round $round $v eval-every $eval wall $(echo "$end - $start" | bc) s $(grep -o 'final_loss=[0-9.]*' "$out/${v}_eval${eval}_r$round.txt") $(grep 'eval step 20' "$out/${v}_eval${eval}_r$round.txt" || true)"
    done
  done
done
