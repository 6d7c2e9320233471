#!/usr/bin/env bash
# The loss the compressed optimizers reach, over several seeds: the rig's 500-step comparison
# (tests/multinode/multinode_test.sh onebit) on a local cluster of four workers, where the
# arithmetic (and so every loss) is the rig's, without its shaped links.
#   bench/compressed_loss_seeds.sh [SEED...]        (default: 1337 2 3)
# For each seed: AdamW, 1-bit Adam (frozen after a fifth of the steps), 1-bit Adam's arithmetic
# never compressed, and 0/1 Adam (variance frozen where 1-bit Adam's is, the local-step interval
# doubling every twentieth of the run up to 4); GPT-2 6 x 384 on the shipped text, one row of 64
# positions a worker a step; the validation loss over 20 held-out batches at the end.
# TESSERA_BIN_DIR: the binaries (default build/bin); TESSERA_LOSS_STEPS: steps (default 500).
# Raw outputs under bench/results/compressed_loss_<date>/ (or $TESSERA_LOSS_OUT); prints one
# line per run and the per-seed and mean differences against AdamW and against the uncompressed
# arithmetic.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${TESSERA_BIN_DIR:-build/bin}
[[ -x "$bin/train_gpt2" ]] || { echo "no $bin/train_gpt2: build first (or set TESSERA_BIN_DIR)" >&2; exit 2; }
steps=${TESSERA_LOSS_STEPS:-500}
out=${TESSERA_LOSS_OUT:-bench/results/compressed_loss_$(date +%F)}
mkdir -p "$out"
seeds=("$@")
[[ ${#seeds[@]} -gt 0 ]] || seeds=(1337 2 3)
freeze=$((steps / 5))
table="$out/losses.tsv"
: >"$table"
for seed in "${seeds[@]}"; do
  for optimizer in adamw onebit-adam onebit-exact zero-one-adam; do
    case "$optimizer" in
      adamw) extra=(--optimizer adamw) ;;
      onebit-adam) extra=(--optimizer onebit-adam --freeze-step "$freeze") ;;
      onebit-exact) extra=(--optimizer onebit-adam --freeze-step $((steps + 1))) ;;
      zero-one-adam) extra=(--optimizer zero-one-adam --var-freeze-step "$freeze"
        --local-step-scaler $((steps / 20)) --local-step-clipper 4) ;;
    esac
    file="$out/$optimizer-seed$seed.out"
    "$bin/train_gpt2" --layers 6 --channels 384 --heads 6 --seq-len 64 --batch 4 --threads 1 \
      --workers 4 --seed "$seed" --steps "$steps" "${extra[@]}" --log-every 50 \
      --val-fraction 0.1 --eval-every "$steps" --eval-batches 20 >"$file" 2>&1 ||
      { echo "train_gpt2 ${extra[*]} --seed $seed failed: $(tail -5 "$file")" >&2; exit 1; }
    val=$(grep -oE "^eval step $steps: val_loss [0-9.]+" "$file" | awk '{ print $5 }')
    [[ -n "$val" ]] || { echo "no validation loss in $file" >&2; exit 1; }
    echo "seed $seed, $optimizer: validation loss $val"
    echo "$seed $optimizer $val" >>"$table"
  done
done
awk '{ v[$1, $2] = $3; seen[$1] = 1 }
  END {
    for (s in seen) {
      a = v[s, "adamw"]; o = v[s, "onebit-adam"]; x = v[s, "onebit-exact"]; z = v[s, "zero-one-adam"]
      printf "seed %s: onebit-adam %+.2f%% of adamw, %+.2f%% of onebit-exact; zero-one-adam %+.2f%% of adamw; onebit-exact %+.2f%% of adamw\n", s, 100 * (o / a - 1), 100 * (o / x - 1), 100 * (z / a - 1), 100 * (x / a - 1)
      n++; so += o / a; sx += o / x; sz += z / a; se += x / a
    }
    printf "mean over %d seeds: onebit-adam %+.2f%% of adamw, %+.2f%% of onebit-exact; zero-one-adam %+.2f%% of adamw; onebit-exact %+.2f%% of adamw\n", n, 100 * (so / n - 1), 100 * (sx / n - 1), 100 * (sz / n - 1), 100 * (se / n - 1)
  }' "$table" | tee "$out/summary.txt"
