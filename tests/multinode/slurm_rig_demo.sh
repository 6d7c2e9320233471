#!/usr/bin/env bash
# Proves tests/multinode/slurm_rig.sh: brings the three-host Slurm cluster up and checks, from the
# head node ts5-h1, what a multi-host test on Slurm needs:
#   - salloc -N 3 gives SLURM_JOB_NODELIST=ts5-h[1-3], and scontrol show hostnames lists 3 hosts;
#   - srun --overlap -N1 -n1 -w ts5-h2 runs in that host (hostname ts5-h2, address 10.77.5.2);
#   - a long srun (sleep) on ts5-h3 keeps running while other sruns come and go, and SIGTERM to
#     its srun client ends the remote task; the same for SIGINT twice (srun's abort) and SIGKILL;
#   - sbatch -N 3 --wait runs a batch script whose srun reaches all three hosts.
# Prints PASS/FAIL a check and exits 0 when all pass, 1 otherwise, 77 when the rig cannot run.
# Then nothing is left: no slurm/munge process, no namespace, no bridge, no directory.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=tests/multinode/slurm_rig.sh
source "$here/slurm_rig.sh"
slurm_rig_up

failures=0
pass() { echo "PASS: $*"; }
failed() { echo "FAIL: $*"; failures=$((failures + 1)); }

# ---- the allocation: one script that salloc runs on the head node ----
cat >"$SLURM_RIG_DIR/alloc.sh" <<'EOF'
set -u
pass() { echo "PASS: $*"; }
failed() { echo "FAIL: $*"; }
# The pid of the remote task running CMD. srun resolves the program's path (/usr/bin/sleep), and
# its own command line ends with CMD too: the first word must end with the program's name.
task_pid() { pgrep -f "^[^ ]*/$1\$" | head -n 1; }
wait_task() {  # CMD: up to 10 s for it to appear
  local _; for _ in $(seq 100); do [[ -n "$(task_pid "$1")" ]] && return 0; sleep 0.1; done; return 1
}
wait_gone() {  # PID: up to 10 s for it to end
  local _; for _ in $(seq 100); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done; return 1
}

echo "salloc: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, running on $(hostname)"
[[ "$SLURM_JOB_NODELIST" == "ts5-h[1-3]" ]] && pass "SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST" ||
  failed "SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr '\n' ' ')
[[ "$hosts" == "ts5-h1 ts5-h2 ts5-h3 " ]] && pass "scontrol show hostnames: $hosts" ||
  failed "scontrol show hostnames: '$hosts'"

out=$(srun --overlap --nodes=1 --ntasks=1 -w ts5-h2 sh -c 'hostname; ip -4 -o addr show dev eth0' 2>&1)
echo "$out" | sed 's/^/    ts5-h2| /'
grep -qx ts5-h2 <<<"$out" && grep -q "inet 10.77.5.2/24" <<<"$out" &&
  pass "srun -w ts5-h2 ran in ts5-h2 (hostname, 10.77.5.2)" || failed "srun -w ts5-h2: $out"

# A long-running task on ts5-h3, its srun client in the background.
srun --overlap --nodes=1 --ntasks=1 -w ts5-h3 sleep 1000 >/dev/null 2>&1 &
client=$!
if wait_task "sleep 1000"; then
  task=$(task_pid "sleep 1000")
  ns=$(ip netns identify "$task")
  [[ "$ns" == ts5-h3 ]] && pass "long task (pid $task) runs in $ns" || failed "long task in '$ns'"
  others=$(srun --overlap -N 3 -n 3 hostname 2>&1 | sort | tr '\n' ' ')
  [[ "$others" == "ts5-h1 ts5-h2 ts5-h3 " ]] && pass "srun -N3 beside it: $others" ||
    failed "srun -N3 beside the long task: $others"
  kill -0 "$task" 2>/dev/null && pass "long task still running after the other sruns" ||
    failed "long task ended with the other sruns"
  kill -TERM "$client"
  wait_gone "$task" && pass "SIGTERM to its srun ended the remote task" ||
    failed "SIGTERM to srun: remote task $task still runs"
  wait "$client" 2>/dev/null
else
  failed "the long task never started on ts5-h3"
fi

# SIGINT: srun reports status on one, aborts the step on a second within a second.
srun --overlap --nodes=1 --ntasks=1 -w ts5-h3 sleep 1001 >/dev/null 2>&1 &
client=$!
if wait_task "sleep 1001"; then
  task=$(task_pid "sleep 1001")
  kill -INT "$client"; sleep 0.2; kill -INT "$client"
  wait_gone "$task" && pass "SIGINT twice to its srun ended the remote task" ||
    failed "SIGINT twice to srun: remote task $task still runs"
  wait "$client" 2>/dev/null
else
  failed "the second long task never started on ts5-h3"
fi
# SIGKILL: srun cannot forward it, yet the step ends with its client.
srun --overlap --nodes=1 --ntasks=1 -w ts5-h3 sleep 1002 >/dev/null 2>&1 &
client=$!
if wait_task "sleep 1002"; then
  task=$(task_pid "sleep 1002")
  disown "$client"  # no "Killed" from bash
  kill -KILL "$client"
  wait_gone "$task" && pass "SIGKILL to its srun ended the remote task" ||
    failed "SIGKILL to srun: remote task $task still runs"
else
  failed "the third long task never started on ts5-h3"
fi
exit 0  # the checks speak for themselves (srun's own status after SIGINT is 130)
EOF
echo "---- salloc -N 3 (on the head node) ----"
alloc_out=$(on_head timeout 120 salloc -N 3 -t 5 bash "$SLURM_RIG_DIR/alloc.sh" 2>&1) ||
  failed "salloc exited $?"
echo "$alloc_out"
n_pass=$(grep -c '^PASS' <<<"$alloc_out" || true)
n_fail=$(grep -c '^FAIL' <<<"$alloc_out" || true)
failures=$((failures + n_fail))
[[ $n_pass -eq 9 ]] || failed "the allocation's script passed $n_pass of 9 checks"

# ---- sbatch ----
echo "---- sbatch -N 3 --wait ----"
cat >"$SLURM_RIG_DIR/batch.sh" <<'EOF'
#!/bin/bash
echo "batch on $(hostname), nodes $SLURM_JOB_NODELIST"
srun hostname | sort
EOF
if on_head timeout 60 sbatch --wait -N 3 -t 5 -o "$SLURM_RIG_DIR/batch-%j.out" \
  "$SLURM_RIG_DIR/batch.sh" >"$SLURM_RIG_DIR/sbatch.out" 2>&1; then
  cat "$SLURM_RIG_DIR/sbatch.out" "$SLURM_RIG_DIR"/batch-*.out
  if [[ "$(tail -n 3 "$SLURM_RIG_DIR"/batch-*.out | tr '\n' ' ')" == "ts5-h1 ts5-h2 ts5-h3 " ]]; then
    pass "sbatch: the batch script's srun ran on the three hosts"
  else
    failed "sbatch output: $(cat "$SLURM_RIG_DIR"/batch-*.out)"
  fi
else
  failed "sbatch --wait: $(cat "$SLURM_RIG_DIR/sbatch.out")"
fi

# ---- down (with the daemons' logs when something failed), and nothing left ----
slurm_rig_down $((failures > 0))
left=$(pgrep -a -f 'slurmctld|slurmd|slurmstepd|slurmscriptd|munged|sleep 100[012]' || true)
if [[ -z "$left" ]]; then pass "after slurm_rig_down: no slurm/munge process"; else failed "processes left: $left"; fi
links=$(ip netns list | grep '^ts5-' || true; ip -br link | grep -E '^(tsbr5|ts5-)' || true)
if [[ -z "$links" ]]; then
  pass "after slurm_rig_down: no ts5-* namespace or link, no tsbr5"
else
  failed "namespaces/links left: $links"
fi

if ((failures == 0)); then echo "PASS (all checks)"; exit 0; fi
echo "FAIL ($failures failed)"
exit 1
