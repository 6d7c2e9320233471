#!/usr/bin/env bash
# `tessera up --slurm` on a real Slurm cluster (Debian's slurmctld and slurmd on three network
# namespace hosts: tests/multinode/slurm_rig.sh). From the head node, inside `salloc -N 3`:
#   1. tessera up --slurm: the scheduler on the allocation's first node, a worker on each node,
#      every one started in an srun step that lasts as long as it does (`tessera start --block`);
#      a second `up` starts nothing;
#   2. attach prints the address (the head's host name) and token; status shows one worker on
#      each host's address;
#   3. train_gpt2 --address trains 3 steps on the three workers (data parallel over all three);
#   4. tessera down --slurm: the steps end, no tessera process is left in any host.
# Exits 0 when all hold, 1 otherwise (the logs printed), 77 (CTest: skipped) where the rig cannot
# run. TESSERA_BIN_DIR: where tessera and train_gpt2 are.
set -euo pipefail
bin_dir="${TESSERA_BIN_DIR:?TESSERA_BIN_DIR must name the directory of tessera and train_gpt2}"
here="$(cd "$(dirname "$0")" && pwd)"
started=$(date +%s.%N)
# shellcheck source=tests/multinode/slurm_rig.sh
source "$here/slurm_rig.sh"
slurm_rig_up
dir="$SLURM_RIG_DIR/tessera"
mkdir -p "$dir"
chmod 755 "$SLURM_RIG_DIR" "$dir"
fail() { echo "FAILED: $*" >&2; show_logs; exit 1; }
show_logs() {
  for f in "$dir"/*.out "$dir"/state/*.log "$dir"/sessions/*/*.log; do
    [[ -f "$f" ]] && { echo "== $f"; tail -n 25 "$f"; }
  done
}

# ---- what runs inside the allocation, on the head node ----
cat >"$dir/inside.sh" <<EOF
set -euo pipefail
t=$bin_dir/tessera
state=$dir/state
echo "job \$SLURM_JOB_ID on \$SLURM_JOB_NODELIST, this is \$(hostname)"
timeout 120 "\$t" up --slurm --state-dir "\$state" --session-root $dir/sessions --port 6390 \\
  > $dir/up.out 2>&1
timeout 60 "\$t" up --slurm --state-dir "\$state" --session-root $dir/sessions --port 6390 \\
  > $dir/up2.out 2>&1
"\$t" attach --slurm --state-dir "\$state" > $dir/attach.out 2>/dev/null
eval "\$(cat $dir/attach.out)"
timeout 30 "\$t" status --address "\$TESSERA_ADDRESS" --token-file "\$TESSERA_TOKEN_FILE" \\
  > $dir/status.out 2>&1
squeue -h -s -j "\$SLURM_JOB_ID" -o '%i %j %N' > $dir/steps.out
timeout 180 $bin_dir/train_gpt2 --address "\$TESSERA_ADDRESS" \\
  --token-file "\$TESSERA_TOKEN_FILE" --preset tiny --steps 3 --batch 6 --seq-len 32 \\
  --zero-stage 2 > $dir/train.out 2>&1
timeout 60 "\$t" down --slurm --state-dir "\$state" > $dir/down.out 2>&1
for _ in \$(seq 50); do
  [[ -z "\$(squeue -h -s -j "\$SLURM_JOB_ID" -o '%j' | grep -x tessera)" ]] && break
  sleep 0.2
done
squeue -h -s -j "\$SLURM_JOB_ID" -o '%i %j %N' > $dir/steps_after.out
EOF
echo "[$(date +%T.%3N)] salloc -N 3: tessera up --slurm, train_gpt2, tessera down --slurm"
on_head timeout 400 salloc -N 3 --job-name=tessera-test bash "$dir/inside.sh" \
  > "$dir/salloc.out" 2>&1 || fail "the allocation's script failed: $(tail -n 5 "$dir/salloc.out")"
cat "$dir/up.out"

# 1. up: the head and three nodes started, and a second up kept them.
grep -q "Tessera cluster 'slurm-[0-9]*' at ts5-h1:6390" "$dir/up.out" || fail "up: $(cat "$dir/up.out")"
[[ $(grep -c "started" "$dir/up.out") -ge 4 ]] || fail "up did not start the head and 3 nodes"
[[ $(grep -c "running, kept" "$dir/up2.out") -eq 4 ]] ||
  fail "the second up changed something: $(cat "$dir/up2.out")"
# Each start is a step named tessera that lasted while the cluster ran (one per host at least).
for host in "${SLURM_RIG_HOSTS[@]}"; do
  grep -q " tessera $host\$" "$dir/steps.out" ||
    fail "no tessera step on $host while the cluster ran: $(cat "$dir/steps.out")"
done
# 2. attach and status.
grep -q "^export TESSERA_ADDRESS=ts5-h1:6390$" "$dir/attach.out" ||
  fail "attach: $(cat "$dir/attach.out")"
for i in 1 2 3; do
  grep -q "node ts5-h$i: 1 of 1 workers alive" "$dir/status.out" ||
    grep -q "$SLURM_RIG_SUBNET.$i:" "$dir/status.out" ||
    fail "status shows no worker of ts5-h$i: $(cat "$dir/status.out")"
done
# 3. training on the three workers.
grep -q "^step 3" "$dir/train.out" || fail "train_gpt2: $(tail -n 20 "$dir/train.out")"
grep -q "3 workers" "$dir/train.out" || fail "train_gpt2 did not use the 3 workers: $(head -n 20 "$dir/train.out")"
# 4. down: the steps ended; no tessera process in any host.
grep -q "down" "$dir/down.out" || fail "down: $(cat "$dir/down.out")"
if grep -q " tessera " "$dir/steps_after.out"; then
  fail "tessera steps outlived down: $(cat "$dir/steps_after.out")"
fi
left=$(pgrep -af "[${bin_dir:0:1}]${bin_dir:1}/tessera " || true)
[[ -z "$left" ]] || fail "tessera processes left after down: $left"
echo "-- the steps while the cluster ran (squeue -s):"
cat "$dir/steps.out"
echo "-- train_gpt2:"
grep -E "workers|^step|summary" "$dir/train.out" | head -n 8
cat "$dir/down.out"
echo "[$(date +%T.%3N)] slurm_test: OK in $(awk -v now="$(date +%s.%N)" -v then="$started" \
  'BEGIN { printf "%.1f", now - then }') s"
