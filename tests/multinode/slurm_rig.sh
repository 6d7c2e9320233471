# shellcheck shell=bash
# A real Slurm cluster on three "hosts" made of Linux network namespaces, for tests that need a
# Slurm allocation (salloc/sbatch/srun) rather than ssh. SOURCE it from a bash test running as
# root, then call slurm_rig_up:
#
#   source tests/multinode/slurm_rig.sh
#   slurm_rig_up                      # exits 77 "SKIPPED: ..." where it cannot run
#   on_head salloc -N 3 bash -c 'srun --overlap -N1 -n1 -w ts5-h2 hostname'
#
# The hosts are network namespaces ts5-h1..ts5-h3 (10.77.5.1..3/24) on a bridge tsbr5
# (10.77.5.254), made as tests/multinode/multinode_test.sh makes its hosts (net number 5, so the
# two never collide). Every daemon runs in its host's namespace with its own UTS namespace, so
# gethostname() there is the host's name: slurmctld in ts5-h1 (Slurm insists that its hostname
# is SlurmctldHost), slurmd -N ts5-hN in each host. Tasks that srun starts run in the namespace
# (network and hostname) of the slurmd of their node. One munged (in the root namespace, a socket
# in the rig's directory: a path socket is shared by every namespace, as the filesystem is)
# authenticates all of them. All namespaces share the filesystem and the pid namespace.
#
# Client commands (sinfo, salloc, sbatch, srun, scontrol, squeue, scancel) run through
# `on_head CMD...`: in ts5-h1's network and UTS namespaces, as a login on the head node, with
# SLURM_CONF set (`on_host HOST CMD...` for another host). srun listens for its step's I/O and
# the slurmd connect back to it: run there, it is 10.77.5.1 to every host. (From the root
# namespace the clients work too, through the bridge as 10.77.5.254, but slurm_rig_down does not
# find them there.) To start a client in the background and keep its pid (to signal srun), use
# the prefix "${SLURM_RIG_ON_HEAD[@]}" (nsenter, which execs): `on_head srun ... &` makes $! a
# subshell's pid, and killing that leaves srun running.
#
# Exports SLURM_RIG_DIR (its temp dir: slurm.conf, logs, state, spool) and SLURM_CONF; sets
# SLURM_RIG_HOSTS (array: ts5-h1 ts5-h2 ts5-h3), SLURM_RIG_HEAD, SLURM_RIG_SUBNET (10.77.5),
# SLURM_RIG_ON_HEAD. slurm_rig_down kills every process of the rig (daemons, slurmstepd, tasks
# and clients in the hosts' namespaces, munged), deletes the namespaces and the bridge and removes
# the directory; slurm_rig_up arranges for it to run on EXIT (before an EXIT trap already set,
# which still runs, with the exit status; a script that sets its EXIT trap after slurm_rig_up
# must call slurm_rig_down from it), and prints the daemons' log tails when the script fails.
# One rig at a time (fixed names): slurm_rig_up fails while another script's rig is up, and
# removes what a script killed with -9 left.
#
# Needs root, ip (iproute2), unshare and nsenter (util-linux), pgrep/pkill (procps), slurmctld,
# slurmd and the clients (Debian: slurmctld slurmd slurm-client) and munge (Debian: munge; where
# munged is missing and the Slurm build still has auth/none, as 22.05 does, it runs without).
# SLURM_RIG_AUTH=munge|none forces one. Tunables: SLURM_RIG_CPUS (CPUs a node, 2),
# SLURM_RIG_UP_TIMEOUT (seconds to wait for three idle nodes, 60).

SLURM_RIG_NET=5
SLURM_RIG_SUBNET="10.77.$SLURM_RIG_NET"
SLURM_RIG_BRIDGE="tsbr$SLURM_RIG_NET"
SLURM_RIG_HOSTS=("ts$SLURM_RIG_NET-h1" "ts$SLURM_RIG_NET-h2" "ts$SLURM_RIG_NET-h3")
SLURM_RIG_HEAD="${SLURM_RIG_HOSTS[0]}"
SLURM_RIG_DIR="${SLURM_RIG_DIR:-}"
export SLURM_RIG_SUBNET SLURM_RIG_HEAD

slurm_rig_log() { echo "[$(date +%T.%3N)] slurm_rig: $*"; }
slurm_rig_skip() { echo "SKIPPED: $*"; exit 77; }
slurm_rig_fail() { echo "FAILED: slurm_rig: $*" >&2; exit 1; }

# The plugin directory of the installed Slurm (Debian: /usr/lib/<triplet>/slurm-wlm).
slurm_rig__plugin_dir() {
  local d
  for d in /usr/lib/*/slurm-wlm /usr/lib/slurm-wlm /usr/lib64/slurm /usr/lib/slurm /usr/local/lib/slurm; do
    [[ -f "$d/auth_munge.so" || -f "$d/auth_none.so" ]] && { echo "$d"; return 0; }
  done
  return 1
}

# The executable NAME: the first in PATH, /usr/sbin or /usr/bin (daemons live in sbin, which a
# non-login PATH may lack). `command -v` is not enough: it names a file that is not executable.
slurm_rig__bin() {
  local dir
  local IFS=:
  for dir in $PATH /usr/sbin /usr/bin; do
    [[ -f "$dir/$1" && -x "$dir/$1" ]] && { echo "$dir/$1"; return 0; }
  done
  return 1
}

slurm_rig__check() {
  [[ $(id -u) -eq 0 ]] || slurm_rig_skip "the Slurm rig needs root to create network namespaces"
  local tool
  for tool in ip unshare nsenter pgrep pkill; do
    slurm_rig__bin "$tool" >/dev/null || slurm_rig_skip "'$tool' is not installed (scripts/install_deps.sh)"
  done
  for tool in slurmctld slurmd; do
    slurm_rig__bin "$tool" >/dev/null ||
      slurm_rig_skip "$tool is not installed (Debian: slurmctld slurmd slurm-client munge)"
  done
  for tool in sinfo salloc sbatch srun scontrol squeue scancel; do
    slurm_rig__bin "$tool" >/dev/null || slurm_rig_skip "'$tool' is not installed (Debian: slurm-client)"
  done
  local plugins
  plugins=$(slurm_rig__plugin_dir) || slurm_rig_skip "Slurm's plugins (auth_*.so) are not installed"
  SLURM_RIG_AUTH="${SLURM_RIG_AUTH:-}"
  if [[ -z "$SLURM_RIG_AUTH" ]]; then
    if slurm_rig__bin munged >/dev/null; then
      SLURM_RIG_AUTH=munge
    elif [[ -f "$plugins/auth_none.so" ]]; then
      SLURM_RIG_AUTH=none
    else
      slurm_rig_skip "munged is not installed (Debian: munge) and this Slurm has no auth/none"
    fi
  fi
  case "$SLURM_RIG_AUTH" in
    munge) slurm_rig__bin munged >/dev/null || slurm_rig_skip "munged is not installed (Debian: munge)" ;;
    none) [[ -f "$plugins/auth_none.so" ]] ||
            slurm_rig_skip "this Slurm has no auth/none plugin (install munge)" ;;
    *) slurm_rig_fail "SLURM_RIG_AUTH must be munge or none, not '$SLURM_RIG_AUTH'" ;;
  esac
  local probe="tsprobe$$"
  ip netns add "$probe" 2>/dev/null || slurm_rig_skip "cannot create network namespaces here (ip netns add failed)"
  ip netns del "$probe"
  # Another rig: one whose script (its owner) still runs is in use (one rig at a time: the names
  # are fixed); one whose script was killed (-9, no teardown) is removed: its processes here, its
  # namespaces and bridge in slurm_rig_up.
  local old owner
  for old in /tmp/tessera-slurm-rig.*; do
    [[ -d "$old" ]] || continue
    owner=$(cat "$old/owner" 2>/dev/null || true)
    if [[ -n "$owner" ]] && kill -0 "$owner" 2>/dev/null; then
      slurm_rig_fail "another Slurm rig is running (script pid $owner, $old); one at a time"
    fi
    pkill -9 -f "[${old:0:1}]${old:1}" 2>/dev/null || true
    rm -rf "$old"
  done
}

# The pid of a process whose namespaces a host's commands enter: its slurmd.
slurm_rig__ns_pid() {
  local host="$1" pid
  pid=$(cat "$SLURM_RIG_DIR/nodes/$host/slurmd.pid" 2>/dev/null) || return 1
  [[ -n "$pid" && -d "/proc/$pid" ]] || return 1
  echo "$pid"
}

# Runs CMD... on host HOST: in the network, UTS and mount namespaces of its slurmd (its hostname,
# its /etc/hosts naming the three hosts), SLURM_CONF set.
on_host() {
  local host="$1" pid
  shift
  pid=$(slurm_rig__ns_pid "$host") || { echo "slurm_rig: no slurmd running on $host" >&2; return 1; }
  SLURM_CONF="$SLURM_CONF" nsenter --target "$pid" --net --uts --mount -- "$@"
}
# Runs CMD... on the head node ts5-h1 (where slurmctld runs): as a user logged in there.
# In the background (`on_head srun ... &`) $! is a subshell's pid, not srun's: killing it leaves
# srun running. For a pid to signal: "${SLURM_RIG_ON_HEAD[@]}" srun ... & pid=$!
on_head() { on_host "$SLURM_RIG_HEAD" "$@"; }

slurm_rig__write_conf() {
  local d="$SLURM_RIG_DIR" cpus="${SLURM_RIG_CPUS:-2}" auth cred authinfo="" i
  if [[ "$SLURM_RIG_AUTH" == munge ]]; then
    auth=auth/munge cred=cred/munge authinfo="AuthInfo=socket=$d/munge/munge.socket"
  else
    auth=auth/none cred=cred/none
  fi
  {
    cat <<EOF
# Written by tests/multinode/slurm_rig.sh
ClusterName=tsrig
SlurmctldHost=$SLURM_RIG_HEAD($SLURM_RIG_SUBNET.1)
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=$auth
CredType=$cred
$authinfo
StateSaveLocation=$d/ctld
SlurmctldPidFile=$d/ctld/slurmctld.pid
SlurmctldLogFile=$d/slurmctld.log
SlurmctldDebug=info
SlurmdSpoolDir=$d/nodes/%n
SlurmdPidFile=$d/nodes/%n/slurmd.pid
SlurmdLogFile=$d/slurmd-%n.log
SlurmdDebug=info
# Three slurmd on one machine: what each detects is the whole machine; take the configured CPUs.
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MailProg=/bin/true
ReturnToService=2
SlurmctldTimeout=10
SlurmdTimeout=10
MessageTimeout=5
TCPTimeout=2
InactiveLimit=0
KillWait=2
MinJobAge=5
Waittime=0
EOF
    for i in 1 2 3; do
      echo "NodeName=${SLURM_RIG_HOSTS[i - 1]} NodeAddr=$SLURM_RIG_SUBNET.$i" \
        "NodeHostname=${SLURM_RIG_HOSTS[i - 1]} CPUs=$cpus Boards=1 SocketsPerBoard=1" \
        "CoresPerSocket=$cpus ThreadsPerCore=1 State=UNKNOWN"
    done
    echo "PartitionName=rig Nodes=${SLURM_RIG_HOSTS[0]%1}[1-3] Default=YES MaxTime=INFINITE State=UP"
  } >"$d/slurm.conf"
  # slurmd (22.05) loads a cgroup plugin whatever the other plugins are, autodetecting the version
  # from /sys/fs/cgroup, and fails where that is not mounted (`ip netns exec` mounts a fresh /sys)
  # or where cgroup v2 is not delegated to it. cgroup/v1's init does nothing; with
  # proctrack/linuxproc, task/none and no CoreSpec/MemSpec nothing else touches cgroups. Read
  # from the directory of slurm.conf.
  echo "CgroupPlugin=cgroup/v1" >"$d/cgroup.conf"
}

slurm_rig__start_munge() {
  local d="$SLURM_RIG_DIR/munge" munged
  munged=$(slurm_rig__bin munged)
  mkdir -m 700 "$d"
  if slurm_rig__bin mungekey >/dev/null; then
    "$(slurm_rig__bin mungekey)" --create --keyfile="$d/munge.key" --force
  else
    dd if=/dev/urandom of="$d/munge.key" bs=1024 count=1 status=none
  fi
  chmod 400 "$d/munge.key"
  # --force: munged runs as root here. Foreground, so its pid is ours; its command line names the
  # rig's directory (the teardown's pattern).
  "$munged" --foreground --force --socket="$d/munge.socket" --key-file="$d/munge.key" \
    --pid-file="$d/munged.pid" --log-file="$d/munged.log" --seed-file="$d/munged.seed" \
    --num-threads=4 </dev/null >>"$d/munged.out" 2>&1 &
  disown $!
  local _
  for _ in $(seq 100); do
    [[ -S "$d/munge.socket" ]] && return 0
    sleep 0.05
  done
  slurm_rig_fail "munged did not create its socket: $(tail -n 5 "$d/munged.log" "$d/munged.out" 2>/dev/null)"
}

slurm_rig__tails() {
  local f
  # A daemon's .out (its stderr) repeats its .log, but holds what it said before it had a log.
  for f in "$SLURM_RIG_DIR"/*.log "$SLURM_RIG_DIR"/munge/munged.log "$SLURM_RIG_DIR"/*.out; do
    [[ -s "$f" ]] || continue
    [[ "$f" == *.out && -s "${f%.out}.log" ]] && continue
    echo "== $f"
    tail -n 25 "$f"
  done
}

# Brings the rig up: hosts, munged, slurmctld, slurmd on each; returns when sinfo shows all
# three nodes idle. Exits 77 (SKIPPED) where it cannot run, 1 (FAILED) when the cluster does not
# come up, with the daemons' logs.
slurm_rig_up() {
  local started; started=$(date +%s.%N)
  slurm_rig__check
  SLURM_RIG_DIR=$(mktemp -d /tmp/tessera-slurm-rig.XXXXXX)
  chmod 755 "$SLURM_RIG_DIR"
  echo "$$" >"$SLURM_RIG_DIR/owner"
  SLURM_CONF="$SLURM_RIG_DIR/slurm.conf"
  export SLURM_RIG_DIR SLURM_CONF
  # Processes of the rig in the root namespace (munged): their command line names its directory.
  SLURM_RIG_PATTERN="[${SLURM_RIG_DIR:0:1}]${SLURM_RIG_DIR:1}"
  slurm_rig__install_traps
  mkdir -p "$SLURM_RIG_DIR/ctld" "$SLURM_RIG_DIR/nodes"

  # ---- the hosts (a stale rig's namespaces and bridge, from a run killed with -9, go first) ----
  local i ns
  for ns in "${SLURM_RIG_HOSTS[@]}"; do slurm_rig__del_ns "$ns"; done
  ip link del "$SLURM_RIG_BRIDGE" 2>/dev/null || true
  ip link add "$SLURM_RIG_BRIDGE" type bridge
  ip addr add "$SLURM_RIG_SUBNET.254/24" dev "$SLURM_RIG_BRIDGE"
  ip link set "$SLURM_RIG_BRIDGE" up
  for i in 1 2 3; do
    ns="${SLURM_RIG_HOSTS[i - 1]}"
    ip netns add "$ns"
    ip link add "$ns-v" type veth peer name eth0 netns "$ns"
    ip link set "$ns-v" master "$SLURM_RIG_BRIDGE" up
    ip -n "$ns" addr add "$SLURM_RIG_SUBNET.$i/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    mkdir -p "$SLURM_RIG_DIR/nodes/$ns"
  done

  # ---- authentication, configuration ----
  [[ "$SLURM_RIG_AUTH" == munge ]] && slurm_rig__start_munge
  slurm_rig__write_conf

  # ---- the daemons, each in its host's network namespace with its own hostname ----
  local ctld slurmd
  ctld=$(slurm_rig__bin slurmctld)
  slurmd=$(slurm_rig__bin slurmd)
  # Foreground (-D), so each pid is the daemon's (ip netns exec, unshare and sh all exec).
  # slurmctld -i: ignore saved state (there is none), start clean.
  # The hosts resolve each other by name, as on a real cluster: every daemon (and so every task
  # and login, which enter its namespaces) sees the rig's hosts file over /etc/hosts, in the
  # mount namespace `ip netns exec` gives it (the machine's own /etc/hosts is untouched).
  {
    echo "127.0.0.1 localhost"
    local i=0
    for ns in "${SLURM_RIG_HOSTS[@]}"; do
      i=$((i + 1))
      echo "$SLURM_RIG_SUBNET.$i $ns"
    done
  } >"$SLURM_RIG_DIR/hosts"
  local hosts_mount="mount --bind $SLURM_RIG_DIR/hosts /etc/hosts"
  SLURM_RIG_DAEMONS=()
  ip netns exec "$SLURM_RIG_HEAD" unshare --uts sh -c \
    "$hosts_mount && hostname $SLURM_RIG_HEAD && exec $ctld -D -i -f $SLURM_CONF" \
    </dev/null >"$SLURM_RIG_DIR/slurmctld.out" 2>&1 &
  SLURM_RIG_DAEMONS+=("$!:slurmctld")
  disown $!
  for ns in "${SLURM_RIG_HOSTS[@]}"; do
    ip netns exec "$ns" unshare --uts sh -c \
      "$hosts_mount && hostname $ns && exec $slurmd -D -N $ns -f $SLURM_CONF" \
      </dev/null >"$SLURM_RIG_DIR/slurmd-$ns.out" 2>&1 &
    SLURM_RIG_DAEMONS+=("$!:slurmd on $ns")
    disown $!
  done

  # ---- wait for three idle nodes (failing at once when a daemon exits) ----
  local timeout="${SLURM_RIG_UP_TIMEOUT:-60}" deadline state="" daemon
  deadline=$(($(date +%s) + timeout))
  while (($(date +%s) < deadline)); do
    for daemon in "${SLURM_RIG_DAEMONS[@]}"; do
      kill -0 "${daemon%%:*}" 2>/dev/null ||
        slurm_rig_fail "${daemon#*:} exited while the cluster came up (logs follow)"
    done
    if slurm_rig__ns_pid "$SLURM_RIG_HEAD" >/dev/null; then
      state=$(on_head timeout 5 sinfo -h -N -o '%N %t' 2>&1 || true)
      [[ $(grep -cE '^ts[0-9]+-h[0-9]+ idle$' <<<"$state") -eq 3 ]] && break
    fi
    sleep 0.3
  done
  [[ $(grep -cE '^ts[0-9]+-h[0-9]+ idle$' <<<"$state") -eq 3 ]] ||
    slurm_rig_fail "the nodes are not all idle after ${timeout}s; sinfo says: ${state:-nothing}"
  # shellcheck disable=SC2034  # for the sourcing script
  SLURM_RIG_ON_HEAD=(nsenter --target "$(slurm_rig__ns_pid "$SLURM_RIG_HEAD")" --net --uts --mount --)
  slurm_rig_log "3 nodes idle (auth/$SLURM_RIG_AUTH, $(awk -v now="$(date +%s.%N)" -v then="$started" \
    'BEGIN { printf "%.1f", now - then }') s); SLURM_CONF=$SLURM_CONF"
}

slurm_rig__del_ns() {
  local ns="$1" pid
  if ip netns list 2>/dev/null | grep -q "^$ns\b"; then
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
      kill -9 "$pid" 2>/dev/null && SLURM_RIG_KILLED+=("$pid")
    done
  fi
  # The veth first: a deleted namespace is freed by the kernel later, sometimes much later, and
  # until then its veth's root end stays (and `ip link add` of the next rig fails: File exists).
  ip link del "$ns-v" 2>/dev/null || true
  ip netns del "$ns" 2>/dev/null || true
}

# Tears the rig down: every process in the hosts' namespaces (slurmctld, slurmd, slurmstepd, the
# tasks, clients run through on_head), munged, the namespaces, the bridge, the directory.
# Idempotent. Prints the logs first when called with a failing status (not 0, not 77).
slurm_rig_down() {
  local code="${1:-0}" ns started
  [[ -n "${SLURM_RIG_DIR:-}" ]] || return 0
  started=$(date +%s.%N)
  if [[ "$code" -ne 0 && "$code" -ne 77 && -d "$SLURM_RIG_DIR" ]]; then
    echo "---- slurm rig logs (exit $code) ----"
    slurm_rig__tails
  fi
  # slurmctld first, with SIGTERM: it reaps its slurmscriptd child, which SIGKILL would leave a
  # zombie for a moment (pgrep would see it). Then everything in the hosts, munged.
  local pid _
  pid=$(cat "$SLURM_RIG_DIR/ctld/slurmctld.pid" 2>/dev/null || true)
  if [[ -n "$pid" ]] && kill -TERM "$pid" 2>/dev/null; then
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  fi
  SLURM_RIG_KILLED=()
  for ns in "${SLURM_RIG_HOSTS[@]}"; do slurm_rig__del_ns "$ns"; done
  pkill -9 -f "$SLURM_RIG_PATTERN" 2>/dev/null || true
  ip link del "$SLURM_RIG_BRIDGE" 2>/dev/null || true
  # Killed processes may hold files a moment, and a killed slurmstepd (a daemon: its parent is
  # init) stays a zombie until init reaps it: up to 3 s for all to be gone, then the directory.
  for _ in $(seq 60); do
    local alive=0
    for pid in "${SLURM_RIG_KILLED[@]}"; do [[ -e "/proc/$pid" ]] && { alive=1; break; }; done
    ((alive == 0)) && ! pgrep -f "$SLURM_RIG_PATTERN" >/dev/null && break
    sleep 0.05
  done
  rm -rf "$SLURM_RIG_DIR"
  SLURM_RIG_DIR=""
  slurm_rig_log "down ($(awk -v now="$(date +%s.%N)" -v then="$started" \
    'BEGIN { printf "%.1f", now - then }') s)"
}

# EXIT: the rig down first, then whatever EXIT trap the script had set, with the exit status.
slurm_rig__install_traps() {
  SLURM_RIG_PREV_EXIT_TRAP=""
  local prev
  prev=$(trap -p EXIT)
  if [[ -n "$prev" ]]; then  # trap -- 'CMD' EXIT: unquote CMD
    prev="${prev#trap -- }"
    eval "SLURM_RIG_PREV_EXIT_TRAP=${prev% EXIT}"
  fi
  trap slurm_rig__on_exit EXIT
  [[ -n "$(trap -p INT)" ]] || trap 'exit 130' INT
  [[ -n "$(trap -p TERM)" ]] || trap 'exit 143' TERM
}
slurm_rig__on_exit() {
  local code=$?
  set +e
  slurm_rig_down "$code"
  if [[ -n "${SLURM_RIG_PREV_EXIT_TRAP:-}" ]]; then
    (exit "$code")
    eval "$SLURM_RIG_PREV_EXIT_TRAP"
  fi
  exit "$code"
}
