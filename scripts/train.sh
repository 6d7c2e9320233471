#!/usr/bin/env bash
# The main job: installs what is missing, builds, and trains a GPT model on the text that ships
# with the project (data/tinyshakespeare.txt). Extra arguments go to train_gpt2, e.g.
#   scripts/train.sh --preset small --steps 300
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
exec build/bin/train_gpt2 --preset tiny --steps 1000 --lr 3e-3 --log-every 50 --eval-every 200 \
  --sample 300 "$@"
