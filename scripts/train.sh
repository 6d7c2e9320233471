#!/usr/bin/env bash
# The main job: installs what is missing, builds, and trains a GPT model on the text that ships
# with the project (data/tinyshakespeare.txt) on an embedded local cluster: a scheduler and two
# worker processes started for the run, with ZeRO-2 (optimizer state and gradients sharded over
# the workers). It prints the loss per step, validation loss, each worker's memory and traffic,
# and a sample. Extra arguments go to train_gpt2, e.g.
#   scripts/train.sh --steps 300 --preset small      # a bigger model
#   scripts/train.sh --workers 4 --zero-stage 3      # another cluster and plan
#   scripts/train.sh --in-process                    # one process, no cluster
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh --main
scripts/build.sh --main
plan=(--workers 2 --zero-stage 2)
for arg in "$@"; do
  case "$arg" in
    --in-process | --workers | --workers=* | --address | --address=*) plan=() ;;
  esac
done
for arg in "$@"; do
  case "$arg" in --zero-stage | --zero-stage=*) [[ ${#plan[@]} -gt 0 ]] && plan=(--workers 2) ;; esac
done
# The run's defaults, each left out where the arguments give that flag (train_gpt2 refuses a
# flag given twice).
defaults=()
for pair in "--preset tiny" "--steps 1000" "--lr 3e-3" "--log-every 50" "--eval-every 200" \
  "--sample 300"; do
  flag=${pair%% *} given=0
  for arg in "$@"; do [[ "$arg" == "$flag" || "$arg" == "$flag="* ]] && given=1; done
  [[ $given -eq 0 ]] && defaults+=($pair)
done
exec build/bin/train_gpt2 "${defaults[@]}" "${plan[@]}" "$@"
