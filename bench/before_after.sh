#!/usr/bin/env bash
# Before/after: the runtime, ZeRO, pipeline and CPU-step benchmarks of two builds, run
# alternately on the same machine in the same session (before, after, before, after, ...), so
# that a restructuring's cost shows against the same noise.
#   bench/before_after.sh BEFORE_BIN AFTER_BIN [OUT_DIR]
# BEFORE_BIN and AFTER_BIN are build/bin directories (each with bench_runtime, bench_zero,
# bench_pipeline, train_gpt2 and tessera). Raw outputs go to OUT_DIR (default
# bench/results/before_after_<date>/), one file per benchmark, build and round; the summary
# (medians of the rounds) is printed and written to OUT_DIR/summary.txt.
# TESSERA_BEFORE_AFTER_ROUNDS: rounds of each benchmark (default 3).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 2 || ! -x "$1/bench_runtime" || ! -x "$2/bench_runtime" ]]; then
  echo "usage: $0 BEFORE_BIN AFTER_BIN [OUT_DIR]  (build/bin directories with the benchmarks)" >&2
  exit 2
fi
before=$(cd "$1" && pwd)
after=$(cd "$2" && pwd)
out=${3:-bench/results/before_after_$(date +%F)}
rounds=${TESSERA_BEFORE_AFTER_ROUNDS:-3}
mkdir -p "$out"
torch=/usr/bin/python3
/usr/bin/python3 -c 'import torch' 2>/dev/null || torch=""

run() {  # run NAME BUILD_LABEL BIN ROUND COMMAND...
  local name=$1 label=$2 bin=$3 round=$4
  shift 4
  local file="$out/${name}_${label}_${round}.txt"
  echo "before_after: $name $label round $round"
  "$@" > "$file" 2>&1 || { echo "before_after: $name $label failed (see $file)" >&2; exit 1; }
}

for round in $(seq 1 "$rounds"); do
  # Alternate which build goes first from round to round.
  if (( round % 2 )); then order=(before after); else order=(after before); fi
  for label in "${order[@]}"; do
    bin=$before
    [[ $label == after ]] && bin=$after
    run runtime "$label" "$bin" "$round" "$bin/bench_runtime"
    run zero "$label" "$bin" "$round" "$bin/bench_zero" --no-torch --steps 10 --warmup 2
    run pipeline "$label" "$bin" "$round" "$bin/bench_pipeline" --stages 2 --micro 8 \
      --schedules 1f1b zb-h1 --steps 3 --warmup 1
    # The CPU step: L=4 C=256 V=50257 T=64 B=4 on random tokens.
    run step "$label" "$bin" "$round" "$bin/train_gpt2" --layers 4 --channels 256 --heads 4 \
      --vocab 50257 --seq-len 64 --batch 4 --data synthetic --steps 8 --threads 2 --log-every 1
  done
done

/usr/bin/python3 bench/before_after_summary.py "$out" | tee "$out/summary.txt"
