#!/usr/bin/env bash
# Multi-node tests: three "hosts" made of Linux network namespaces (each with its own UTS
# namespace, so its own hostname), joined by a bridge through veth pairs, with commodity-Ethernet
# latency and bandwidth on every host's link (tc netem). Each host runs OpenSSH's sshd; the
# cluster is brought up with `tessera up` from a YAML file over ssh, exactly as on real hosts.
#
#   multinode_test.sh train        GPT-2 tiny, ZeRO-3 on 3 hosts over TCP, matches 1 worker;
#                                  `tessera down` leaves no process in any namespace; then the
#                                  same hosts from a hostfile without tessera_binary (found where
#                                  `tessera up` runs), the dashboard URL printed by up and attach
#   multinode_test.sh link_down    a host's link goes down mid-training: the driver fails
#                                  naming that host, within the heartbeat bound; nothing hangs
#   multinode_test.sh kill_worker  a host's worker is SIGKILLed mid-training: the same
#   multinode_test.sh onebit       a benchmark (not a CTest test), on 4 hosts: a GPT-2 of ~11M
#                                  parameters in data parallel, Tessera's AdamW (f32 ring), its
#                                  1-bit Adam, its 0/1 Adam, PyTorch DDP (gloo) and DDP with
#                                  PowerSGD (rank 1, bench/torch_ddp_gpt2.py, one process a host),
#                                  alternated, twice each; each run's median and mean step time
#                                  over the compressed phase's steps and the ratios
#                                  (TESSERA_ONEBIT_ROUNDS rounds, 2). Then AdamW, 1-bit Adam, 1-bit
#                                  Adam never compressing (its warm-up arithmetic throughout) and
#                                  0/1 Adam for TESSERA_ONEBIT_LONG_STEPS (500; 0: none) steps on
#                                  the shipped text, their losses side by side
#                                  (TESSERA_ONEBIT_PEERS, TESSERA_ONEBIT_LONG_PEERS: other
#                                  contenders, e.g. "zero3 zero3-int8 zero3-int4": ZeRO-3 with its
#                                  collectives exact or quantized)
#                                  (bench/results; TESSERA_ONEBIT_SEQ_LEN: positions a row, 64)
#
# Needs root, ip netns, tc, sshd, ssh and ssh-keygen; exits 77 (CTest: skipped) saying which is
# missing. Everything it makes (namespaces, bridge, processes, files) is removed on exit, also
# when it fails or is interrupted. TESSERA_BIN_DIR: where tessera and train_gpt2 are.
set -euo pipefail

mode="${1:?usage: multinode_test.sh train|link_down|kill_worker|onebit}"
bin_dir="${TESSERA_BIN_DIR:?TESSERA_BIN_DIR must name the directory of tessera and train_gpt2}"
case "$mode" in
  train) net=0 ;;
  link_down) net=1 ;;
  kill_worker) net=2 ;;
  onebit) net=3 ;;
  *) echo "unknown mode '$mode'" >&2; exit 2 ;;
esac

skip() { echo "SKIPPED: $*"; exit 77; }
[[ $(id -u) -eq 0 ]] || skip "needs root to create network namespaces (run as root, e.g. in CI)"
for tool in ip tc ssh ssh-keygen unshare pgrep; do
  command -v "$tool" >/dev/null || skip "'$tool' is not installed (scripts/install_deps.sh)"
done
[[ -x /usr/sbin/sshd ]] || skip "/usr/sbin/sshd is missing (Debian: openssh-server)"
probe_ns="tsprobe$$"
ip netns add "$probe_ns" 2>/dev/null || skip "cannot create network namespaces here (ip netns add failed)"
ip netns del "$probe_ns"

started=$(date +%s.%N)
subnet="10.77.$net"
bridge="tsbr$net"
hosts=(1 2 3)
[[ "$mode" == onebit ]] && hosts=(1 2 3 4)
ns_of() { echo "ts$net-h$1"; }
dir=$(mktemp -d "/tmp/tessera-multinode-$mode.XXXXXX")
chmod 755 "$dir"
cluster="mn-$mode"
state="$dir/state"
tessera=("$bin_dir/tessera")
log() { echo "[$(date +%T.%3N)] $*"; }
elapsed() { awk -v now="$(date +%s.%N)" -v then="$1" 'BEGIN { printf "%.1f", now - then }'; }

# Processes of this test: anything whose command line names its directory, in any namespace
# (they share the pid namespace). The bracket keeps the pattern from matching itself.
pattern="[${dir:0:1}]${dir:1}"
cleanup() {
  local code=$?
  set +e
  [[ -n "${train_pid:-}" ]] && kill -9 "$train_pid" 2>/dev/null
  pkill -9 -f "$pattern" 2>/dev/null
  for i in "${hosts[@]}"; do
    local ns; ns=$(ns_of "$i")
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
    ip link del "$ns-v" 2>/dev/null  # the root side of its veth may outlive the namespace
  done
  ip link del "$bridge" 2>/dev/null
  if [[ $code -ne 0 && $code -ne 77 ]]; then
    echo "---- logs (test failed, exit $code) ----"
    for f in "$dir"/*.log "$dir"/sessions/*/*.log; do
      [[ -f "$f" ]] && { echo "== $f"; tail -n 30 "$f"; }
    done
  fi
  rm -rf "$dir" /tmp/tessera/mn-hosts-*  # the hostfile cluster's sessions (the default root)
  log "cleaned up; $mode took $(elapsed "$started") s"
  exit $code
}
trap cleanup EXIT
trap 'exit 130' INT TERM
fail() { echo "FAILED: $*" >&2; exit 1; }

# ---- the hosts ----
ip link del "$bridge" 2>/dev/null || true
ip link add "$bridge" type bridge
ip addr add "$subnet.254/24" dev "$bridge"
ip link set "$bridge" up
for i in "${hosts[@]}"; do
  ns=$(ns_of "$i")
  ip netns del "$ns" 2>/dev/null || true
  ip link del "$ns-v" 2>/dev/null || true  # a veth left by a run killed with -9
  ip netns add "$ns"
  ip link add "$ns-v" type veth peer name eth0 netns "$ns"
  ip link set "$ns-v" master "$bridge" up
  ip -n "$ns" addr add "$subnet.$i/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  # Commodity Ethernet: 1 ms each way out of every host, 1 Gbit/s. Kernels without sch_netem
  # (some containers) get the bandwidth alone, from tbf.
  if ! ip netns exec "$ns" tc qdisc add dev eth0 root netem delay 1ms rate 1gbit 2>/dev/null; then
    ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate 1gbit burst 128kb latency 50ms
    shaping="tbf 1 Gbit/s (no netem in this kernel: no added latency)"
  fi
done
log "links: ${shaping:-netem 1 ms, 1 Gbit/s}"

# ---- sshd in every host, a key for the launcher ----
ssh-keygen -q -t ed25519 -N '' -f "$dir/host_key"
ssh-keygen -q -t ed25519 -N '' -f "$dir/id"
cp "$dir/id.pub" "$dir/authorized_keys"
mkdir -p /run/sshd
for i in "${hosts[@]}"; do
  ns=$(ns_of "$i")
  cat >"$dir/sshd-$i.conf" <<EOF
ListenAddress $subnet.$i
Port 22
HostKey $dir/host_key
PidFile $dir/sshd-$i.pid
AuthorizedKeysFile $dir/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
MaxStartups 100
EOF
  # Its own UTS namespace: the host's own hostname, which workers report and errors name.
  ip netns exec "$ns" unshare --uts sh -c \
    "hostname $ns && exec /usr/sbin/sshd -D -f $dir/sshd-$i.conf -E $dir/sshd-$i.log" &
  disown $!
done
for i in "${hosts[@]}"; do
  for _ in $(seq 50); do
    ssh -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null \
      -o LogLevel=ERROR -i "$dir/id" "root@$subnet.$i" true 2>/dev/null && continue 2
    sleep 0.1
  done
  fail "sshd in $(ns_of "$i") does not answer (log: $(cat "$dir/sshd-$i.log" 2>/dev/null))"
done
log "${#hosts[@]} hosts up, sshd answering in each"

# ---- the cluster ----
cat >"$dir/$cluster.yaml" <<EOF
cluster_name: $cluster
head: {address: $subnet.1, port: 6380}
nodes:
$(for i in "${hosts[@]}"; do echo "  - {address: $subnet.$i, workers: 1, threads: 1}"; done)
ssh: {user: root, key: $dir/id, connect_timeout_s: 5}
setup_commands: ["test -x ${tessera[0]}"]
env: {TESSERA_SCHEDULER_GRACE_MS: "2000"}
tessera_binary: ${tessera[0]}
session_root: $dir/sessions
join_timeout_s: 30
EOF
up_started=$(date +%s.%N)
timeout 90 "${tessera[@]}" up "$dir/$cluster.yaml" --state-dir "$state" | tee "$dir/up.out" ||
  fail "tessera up failed"
log "tessera up took $(elapsed "$up_started") s"
grep -q "ok: started 1" "$dir/up.out" || fail "tessera up did not report the nodes started"
# Idempotent: a second `up` starts nothing.
timeout 60 "${tessera[@]}" up "$dir/$cluster.yaml" --state-dir "$state" >"$dir/up2.out" ||
  fail "the second tessera up failed: $(cat "$dir/up2.out")"
[[ $(grep -c "running, kept" "$dir/up2.out") -eq $((${#hosts[@]} + 1)) ]] ||
  fail "the second tessera up changed something: $(cat "$dir/up2.out")"
eval "$("${tessera[@]}" attach "$dir/$cluster.yaml" --state-dir "$state" 2>/dev/null)"
[[ "$TESSERA_ADDRESS" == "$subnet.1:6380" ]] || fail "attach printed '$TESSERA_ADDRESS'"
status=$(timeout 20 "${tessera[@]}" status --address "$TESSERA_ADDRESS" --token-file "$TESSERA_TOKEN_FILE")
for i in "${hosts[@]}"; do
  grep -q "node $(ns_of "$i"): 1 of 1 workers alive" <<<"$status" || fail "status: $status"
  grep -q "$subnet.$i:" <<<"$status" || fail "no worker advertises $subnet.$i: $status"
done

# The tessera processes of host i (its namespace's pids that run the tessera binary).
tessera_pids_in() {
  for pid in $(ip netns pids "$(ns_of "$1")"); do
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "${tessera[0]} " && echo "$pid"
  done
  true
}

down_and_check() {
  timeout 60 "${tessera[@]}" down "$dir/$cluster.yaml" --state-dir "$state" | tee "$dir/down.out" ||
    fail "tessera down failed"
  for i in "${hosts[@]}"; do
    left=$(tessera_pids_in "$i")
    [[ -z "$left" ]] || fail "tessera processes left in $(ns_of "$i"): $left"
  done
  ! pgrep -f "$pattern/sessions" >/dev/null || fail "processes of the cluster are left: $(pgrep -af "$pattern/sessions")"
  log "tessera down: no tessera process left in any namespace"
}

gpt2=("$bin_dir/train_gpt2" --preset tiny --zero-stage 3 --batch 12 --threads 1 --log-every 1)

if [[ "$mode" == train ]]; then
  steps=4
  train_started=$(date +%s.%N)
  timeout 180 "${gpt2[@]}" --steps $steps --address "$TESSERA_ADDRESS" --workers 3 \
    --token-file "$TESSERA_TOKEN_FILE" >"$dir/cluster.out" 2>&1 ||
    fail "train_gpt2 on the cluster failed: $(tail -20 "$dir/cluster.out")"
  log "ZeRO-3 on 3 hosts: $steps steps in $(elapsed "$train_started") s"
  timeout 180 "${gpt2[@]}" --steps $steps --workers 1 >"$dir/alone.out" 2>&1 ||
    fail "train_gpt2 on one worker failed: $(tail -20 "$dir/alone.out")"
  losses() { grep -oE "step [0-9]+/$steps loss [0-9.]+" "$1" | awk '{print $4}'; }
  mapfile -t on_cluster < <(losses "$dir/cluster.out")
  mapfile -t alone < <(losses "$dir/alone.out")
  [[ ${#on_cluster[@]} -eq $steps && ${#alone[@]} -eq $steps ]] ||
    fail "expected $steps losses each: cluster '${on_cluster[*]}', alone '${alone[*]}'"
  for s in $(seq 0 $((steps - 1))); do
    awk -v a="${on_cluster[$s]}" -v b="${alone[$s]}" \
      'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-5 * b) }' ||
      fail "step $((s + 1)): loss ${on_cluster[$s]} on 3 hosts, ${alone[$s]} on one worker"
  done
  final_cluster=$(grep -oE "final_loss=[0-9.]+" "$dir/cluster.out" | cut -d= -f2)
  final_alone=$(grep -oE "final_loss=[0-9.]+" "$dir/alone.out" | cut -d= -f2)
  awk -v a="$final_cluster" -v b="$final_alone" \
    'BEGIN { d = a - b; if (d < 0) d = -d; exit !(b > 0 && d <= 1e-5 * b) }' ||
    fail "final loss $final_cluster on 3 hosts, $final_alone on one worker"
  log "losses match one worker within 1e-5: ${on_cluster[*]} ($final_cluster vs $final_alone)"
  # A node that cannot be reached is reported with ssh's reason; the rest is kept as it is.
  sed "s/^nodes:/nodes:\n  - {address: $subnet.9, workers: 1}/" "$dir/$cluster.yaml" >"$dir/$cluster-plus.yaml"
  sed -i "s/^ssh: {user: root, key: \(.*\), connect_timeout_s: 5}/ssh: {user: root, key: \1, connect_timeout_s: 2}/" \
    "$dir/$cluster-plus.yaml"
  if timeout 60 "${tessera[@]}" up "$dir/$cluster-plus.yaml" --state-dir "$state" >"$dir/up3.out" 2>&1; then
    fail "tessera up with an unreachable node succeeded: $(cat "$dir/up3.out")"
  fi
  grep -qE "$subnet.9 .*FAILED: ssh cannot reach $subnet.9" "$dir/up3.out" ||
    fail "the unreachable node is not reported with its reason: $(cat "$dir/up3.out")"
  [[ $(grep -c "running, kept" "$dir/up3.out") -eq 4 ]] ||
    fail "tessera up touched the running hosts: $(cat "$dir/up3.out")"
  log "an unreachable node is reported: $(grep "$subnet.9" "$dir/up3.out")"
  down_and_check
  # A DeepSpeed-style hostfile, ssh from the command line, no tessera_binary: every host runs
  # tessera from where `tessera up` runs; up and attach print the dashboard's URL.
  for i in "${hosts[@]}"; do echo "$subnet.$i slots=1"; done >"$dir/mn-hosts"
  ssh_flags=(--ssh-user root --ssh-key "$dir/id" --state-dir "$state")
  timeout 90 "${tessera[@]}" up "$dir/mn-hosts" "${ssh_flags[@]}" >"$dir/hosts-up.out" 2>&1 ||
    fail "tessera up of a hostfile failed: $(cat "$dir/hosts-up.out")"
  [[ $(grep -c "ok: started 1" "$dir/hosts-up.out") -eq ${#hosts[@]} ]] ||
    fail "tessera up of a hostfile did not start every host: $(cat "$dir/hosts-up.out")"
  grep -qE "^dashboard: http://$subnet.1:[0-9]+/\?token=[0-9a-f]+$" "$dir/hosts-up.out" ||
    fail "tessera up printed no dashboard URL: $(cat "$dir/hosts-up.out")"
  eval "$("${tessera[@]}" attach "$dir/mn-hosts" "${ssh_flags[@]}" 2>"$dir/hosts-attach.err")"
  grep -qE "^# dashboard: http://$subnet.1:[0-9]+/" "$dir/hosts-attach.err" ||
    fail "tessera attach printed no dashboard URL: $(cat "$dir/hosts-attach.err")"
  status=$(timeout 20 "${tessera[@]}" status --address "$TESSERA_ADDRESS" --token-file "$TESSERA_TOKEN_FILE")
  for i in "${hosts[@]}"; do
    grep -q "node $(ns_of "$i"): 1 of 1 workers alive" <<<"$status" || fail "status: $status"
  done
  log "a hostfile without tessera_binary: $(grep -c "ok: started 1" "$dir/hosts-up.out") hosts up; $(grep "^dashboard" "$dir/hosts-up.out" | cut -d'?' -f1)"
  timeout 60 "${tessera[@]}" down "$dir/mn-hosts" "${ssh_flags[@]}" >"$dir/hosts-down.out" 2>&1 ||
    fail "tessera down of the hostfile failed: $(cat "$dir/hosts-down.out")"
  for i in "${hosts[@]}"; do
    left=$(tessera_pids_in "$i")
    [[ -z "$left" ]] || fail "tessera processes left in $(ns_of "$i"): $left"
  done
  exit 0
fi

if [[ "$mode" == onebit ]]; then
  # Communication-bound on purpose: one row of 64 positions per worker a step, so the f32 ring
  # all-reduce of ~44 MB of gradients over 1 Gbit/s links outweighs the compute.
  steps=30
  freeze=10
  seq_len="${TESSERA_ONEBIT_SEQ_LEN:-64}"
  workers=${#hosts[@]}
  repo=$(cd "$(dirname "$0")/../.." && pwd)
  log "GPT-2 6 x 384 (~11M parameters), $workers workers x 1 row of $seq_len positions a step"
  bench=("$bin_dir/train_gpt2" --layers 6 --channels 384 --heads 6 --seq-len "$seq_len"
    --batch "$workers" --threads 1 --address "$TESSERA_ADDRESS" --workers "$workers"
    --token-file "$TESSERA_TOKEN_FILE")
  # The median of a list of numbers, one a line.
  median() {
    sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) exit 1; print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'
  }
  step_lines() { grep -oE "^step [0-9]+/$2 loss [0-9.]+ +[0-9.]+ ms" "$1"; }
  # PyTorch DDP over gloo, one process a host (eth0 of its namespace), the same model and
  # shapes; $1: PowerSGD's rank (0: plain all-reduce, DDP's buckets; PowerSGD runs one bucket:
  # torch 1.13's hook can launch two buckets' all-reduces in different orders on different
  # ranks, a gloo size mismatch). Prints rank 0's JSON line.
  torch_ddp() {
    local port=$((29500 + RANDOM % 400)) pids=() i buckets=25
    [[ $1 -gt 0 ]] && buckets=1000
    for i in "${hosts[@]}"; do
      ip netns exec "$(ns_of "$i")" env GLOO_SOCKET_IFNAME=eth0 PYTHONPATH="$repo/bench" \
        timeout 600 /usr/bin/python3 "$repo/bench/torch_ddp_gpt2.py" --workers "$workers" \
        --layers 6 --channels 384 --heads 6 --vocab 256 --seq-len "$seq_len" --batch "$workers" \
        --warmup $((freeze + 1)) --steps $((steps - freeze - 1)) --powersgd-rank "$1" \
        --start-powersgd-iter "$freeze" --bucket-mb "$buckets" --rank $((i - 1)) \
        --init-method "tcp://$subnet.1:$port" >"$dir/torch-$1-rank$i.out" 2>&1 &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do
      wait "$pid" || fail "torch DDP failed: $(tail -n 5 "$dir"/torch-"$1"-rank*.out 2>&1)"
    done
    grep -h '^{' "$dir/torch-$1-rank1.out"
  }
  if /usr/bin/python3 -c "import torch" 2>/dev/null; then
    peers=(adamw onebit-adam zero-one-adam torch-ddp torch-powersgd)
  else
    log "no PyTorch for /usr/bin/python3 (scripts/install_deps.sh --bench): Tessera only"
    peers=(adamw onebit-adam zero-one-adam)
  fi
  # TESSERA_ONEBIT_PEERS: the contenders instead (e.g. "zero3 zero3-int8 zero3-int4": ZeRO-3
  # with AdamW, its collectives exact or quantized).
  [[ -n "${TESSERA_ONEBIT_PEERS:-}" ]] && read -r -a peers <<<"$TESSERA_ONEBIT_PEERS"
  # A Tessera contender's train_gpt2 flags. 0/1 Adam's variance frozen where 1-bit Adam's is;
  # then its local-step interval doubles every 4 steps up to 4 (syncs at 11-14, 16, 18, 20,
  # 24, 28: the skipped rounds), so its steps are measured by their mean, not their median (a
  # local step's).
  flags_of() {
    case "$1" in
      adamw | onebit-adam) echo "--optimizer $1 --freeze-step $freeze" ;;
      zero-one-adam) echo "--optimizer $1 --var-freeze-step $freeze --local-step-scaler 4 --local-step-clipper 4" ;;
      zero3) echo "--optimizer adamw --zero-stage 3" ;;
      zero3-int8 | zero3-int4) echo "--optimizer adamw --zero-stage 3 --quantize-collectives ${1#zero3-}" ;;
      *) fail "unknown contender $1" ;;
    esac
  }
  for round in $(seq "${TESSERA_ONEBIT_ROUNDS:-2}"); do
    # Alternated: each round runs every contender once, the order reversed in even rounds.
    order=("${peers[@]}")
    [[ $((round % 2)) -eq 0 ]] && mapfile -t order < <(printf '%s\n' "${peers[@]}" | tac)
    for peer in "${order[@]}"; do
      case "$peer" in
        torch-*)
          rank=0
          [[ $peer == torch-powersgd ]] && rank=1
          json=$(torch_ddp $rank)
          ms=$(sed -E 's/.*"median_ms": ([0-9.]+).*/\1/' <<<"$json")
          log "round $round, $peer: median step ${ms} ms over steps $((freeze + 2))-$steps: $json"
          echo "$round $peer $ms - -" >>"$dir/onebit.tsv"
          ;;
        *)
          out="$dir/$peer-$round.out"
          read -r -a extra <<<"$(flags_of "$peer")"
          timeout 600 "${bench[@]}" --steps $steps --log-every 1 "${extra[@]}" >"$out" 2>&1 ||
            fail "train_gpt2 ${extra[*]} failed: $(tail -20 "$out")"
          # The median and mean step times over steps freeze+2 .. steps (the compressed phase,
          # past its switch); end to end: every step's time, the warm-up's and the switch's.
          ms=$(step_lines "$out" $steps | awk -v from=$((freeze + 2)) \
            '{ split($2, s, "/"); if (s[1] >= from) print $5 }' | median) ||
            fail "no step times in $out"
          mean=$(step_lines "$out" $steps | awk -v from=$((freeze + 2)) \
            '{ split($2, s, "/"); if (s[1] >= from) { t += $5; n++ } } END { printf "%.1f", t / n }')
          total=$(step_lines "$out" $steps | awk '{ t += $5 } END { printf "%.0f", t }')
          final=$(grep -oE "final_loss=[0-9.]+" "$out" | cut -d= -f2)
          log "round $round, $peer: median step ${ms} ms, mean ${mean} ms over steps $((freeze + 2))-$steps, all $steps steps ${total} ms, final loss $final"
          echo "$round $peer $ms $final $total $mean" >>"$dir/onebit.tsv"
          ;;
      esac
    done
  done
  [[ -f "$dir/onebit.tsv" ]] &&
  awk '{ ms[$2] = ms[$2] " " $3 } END { for (o in ms) print o ":" ms[o] }' "$dir/onebit.tsv" &&
  awk '{ n[$2]++; s[$2] += $3; if ($5 != "-") e[$2] += $5; if (NF >= 6) u[$2] += $6 }
    END {
      for (p in u) if (p != "adamw" && p != "onebit-adam" && p != "zero-one-adam") printf "%s: mean of the rounds'"'"' means %.1f ms, all steps %.0f ms a run\n", p, u[p] / n[p], e[p] / n[p]
      if (n["adamw"] == 0 || n["onebit-adam"] == 0) exit
      a = s["adamw"] / n["adamw"]; o = s["onebit-adam"] / n["onebit-adam"]
      printf "mean of the rounds'"'"' medians: adamw %.1f ms, onebit-adam %.1f ms, ratio %.2fx; end to end (all steps): %.2fx\n", a, o, a / o, e["adamw"] / e["onebit-adam"]
      if (n["zero-one-adam"] > 0) {
        am = u["adamw"] / n["adamw"]; om = u["onebit-adam"] / n["onebit-adam"]; z = u["zero-one-adam"] / n["zero-one-adam"]
        printf "mean of the rounds'"'"' means: adamw %.1f ms, onebit-adam %.1f ms (%.2fx), zero-one-adam %.1f ms (%.2fx); end to end: zero-one-adam %.2fx\n", am, om, am / om, z, am / z, e["adamw"] / e["zero-one-adam"]
      }
      if (n["torch-ddp"] > 0) {
        d = s["torch-ddp"] / n["torch-ddp"]; p = s["torch-powersgd"] / n["torch-powersgd"]
        printf "PyTorch DDP %.1f ms (Tessera adamw %.2fx faster), DDP + PowerSGD rank 1 %.1f ms (Tessera onebit-adam %.2fx faster)\n", d, d / a, p, p / o
      }
    }' "$dir/onebit.tsv"
  long="${TESSERA_ONEBIT_LONG_STEPS:-500}"
  if [[ "$long" -gt 0 ]]; then
    # The loss after $long steps on the shipped text (a tenth held out): the same batches for
    # all, 1-bit Adam frozen after a fifth of them, and never (onebit-exact: its arithmetic
    # uncompressed, what the compression alone changes); the validation loss over 20 batches at
    # the end, and the mean training loss over the last 10 logged steps.
    # 0/1 Adam: the variance frozen where 1-bit Adam's is, the local-step interval doubling
    # every twentieth of the run up to 4.
    # TESSERA_ONEBIT_LONG_PEERS: these contenders instead (flags_of's, or onebit-exact).
    long_peers=(adamw onebit-adam onebit-exact zero-one-adam)
    [[ -n "${TESSERA_ONEBIT_LONG_PEERS:-}" ]] && read -r -a long_peers <<<"$TESSERA_ONEBIT_LONG_PEERS"
    for peer in "${long_peers[@]}"; do
      out="$dir/$peer-long.out"
      freeze=$((long / 5))
      case "$peer" in
        onebit-exact) extra=(--optimizer onebit-adam --freeze-step $((long + 1))) ;;
        zero-one-adam) extra=(--optimizer zero-one-adam --var-freeze-step "$freeze"
          --local-step-scaler $((long / 20)) --local-step-clipper 4) ;;
        *) read -r -a extra <<<"$(flags_of "$peer")" ;;
      esac
      timeout 3000 "${bench[@]}" --steps "$long" "${extra[@]}" \
        --log-every 10 --val-fraction 0.1 --eval-every "$long" --eval-batches 20 >"$out" 2>&1 ||
        fail "train_gpt2 ${extra[*]} failed: $(tail -20 "$out")"
      val=$(grep -oE "^eval step $long: val_loss [0-9.]+" "$out" | awk '{ print $5 }')
      [[ -n "$val" ]] || fail "no validation loss in $out"
      last=$(grep -oE "^step [0-9]+/$long loss [0-9.]+" "$out" | tail -10 |
        awk '{ t += $4 } END { printf "%.4f", t / NR }')
      # End to end: every step's time together (the summary's steps_s), warm-up included.
      seconds=$(grep -oE "^summary: .* steps_s=[0-9.]+" "$out" | sed -E 's/.*steps_s=//')
      [[ -n "$seconds" ]] || fail "no steps_s in the summary of $out"
      log "$long steps, $peer: validation loss $val, mean of the last 10 logged losses $last ($(grep -oE "^summary: .*" "$out"))"
      echo "$peer $val $last $seconds" >>"$dir/long.tsv"
    done
    awk '{ v[$1] = $2; m[$1] = $3; t[$1] = $4 } END {
      if ("adamw" in t) for (p in t) if (p != "adamw") printf "end to end over the long run (every step, warm-up included): %s %.1f s against adamw %.1f s, %.2fx\n", p, t[p], t["adamw"], t["adamw"] / t[p]
      for (p in v) printf "%s: validation loss %.4f, mean of the last logged training losses %.4f\n", p, v[p], m[p]
      if (!("adamw" in v) || !("onebit-adam" in v)) exit
      printf "after the long run: validation loss adamw %.4f, onebit-adam %.4f (%+.2f%%), onebit-exact %.4f (onebit-adam %+.2f%% of it)\n", v["adamw"], v["onebit-adam"], 100 * (v["onebit-adam"] / v["adamw"] - 1), v["onebit-exact"], 100 * (v["onebit-adam"] / v["onebit-exact"] - 1)
      printf "mean of the last logged training losses: adamw %.4f, onebit-adam %.4f, onebit-exact %.4f\n", m["adamw"], m["onebit-adam"], m["onebit-exact"]
      if ("zero-one-adam" in v) printf "zero-one-adam: validation loss %.4f (%+.2f%% of adamw), mean of the last logged training losses %.4f\n", v["zero-one-adam"], 100 * (v["zero-one-adam"] / v["adamw"] - 1), m["zero-one-adam"] }' "$dir/long.tsv"
  fi
  down_and_check
  exit 0
fi

# ---- faults: a long run, then break host 3 mid-step ----
"${gpt2[@]}" --steps 100000 --address "$TESSERA_ADDRESS" --workers 3 \
  --token-file "$TESSERA_TOKEN_FILE" >"$dir/fault.out" 2>&1 &
train_pid=$!
for _ in $(seq 600); do
  grep -q "step 2/" "$dir/fault.out" && break
  kill -0 "$train_pid" 2>/dev/null || fail "train_gpt2 ended early: $(tail -20 "$dir/fault.out")"
  sleep 0.1
done
grep -q "step 2/" "$dir/fault.out" || fail "train_gpt2 did not reach step 2 in 60 s"
victim="$(ns_of 3)"
if [[ "$mode" == link_down ]]; then
  log "taking $victim's link down"
  ip link set "$victim-v" down
else
  worker_pid=""
  for pid in $(tessera_pids_in 3); do
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q " worker " && worker_pid=$pid
  done
  [[ -n "$worker_pid" ]] || fail "no worker process in $victim"
  log "SIGKILL to $victim's worker (pid $worker_pid)"
  kill -9 "$worker_pid"
fi
fault_at=$(date +%s.%N)
# Hard deadline: the heartbeat bound is 3 s; allow generously for detection and reporting.
for _ in $(seq 300); do
  kill -0 "$train_pid" 2>/dev/null || break
  sleep 0.1
done
if kill -0 "$train_pid" 2>/dev/null; then fail "train_gpt2 still runs 30 s after the fault"; fi
code=0
wait "$train_pid" || code=$?
train_pid=""
took=$(elapsed "$fault_at")
[[ $code -ne 0 ]] || fail "train_gpt2 succeeded despite the fault"
error=$(grep -iE "error|failed|died|dead" "$dir/fault.out" | tail -5)
grep -qE "on $victim\b" <<<"$error" || fail "the error does not name $victim: $error"
log "the driver failed ${took} s after the fault, naming $victim: $(tail -1 <<<"$error")"
if [[ "$mode" == link_down ]]; then ip link set "$victim-v" up; fi
down_and_check
