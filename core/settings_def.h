// Every Tessera setting, declared once: type, name, default, the values it may take, unit, and
// what it trades off. Included by settings.h/settings.cc with TESSERA_SETTING and
// TESSERA_INT_SETTING defined; do not include elsewhere. Each can be overridden by the
// environment variable TESSERA_<NAME IN CAPITALS>; a value outside its range is refused when the
// environment is read (Settings::FromEnvironment), naming the variable and the range, before any
// component sees it.
//
// TESSERA_SETTING(type, name, default, unit, description)           a bool or a string
// TESSERA_INT_SETTING(name, default, min, max, unit, description)   an int64_t in [min, max]

TESSERA_INT_SETTING(cpu_threads, 0, 0, 4096, "threads",
                    "Threads in the CPU executor's TBB arena (kernels and independent tasks share "
                    "them). 0 means one per core. More than the cores only adds contention.")

TESSERA_INT_SETTING(gemm_split_min_flops, 4000000, 0, int64_t{1} << 62, "flop",
                    "GEMMs smaller than this run on one thread; larger ones are split across the "
                    "arena. Lower splits more small GEMMs (more overhead per split).")

TESSERA_INT_SETTING(
    idle_spin_us, 100, 0, 100000, "us",
    "How long a thread that ran out of work (an io loop; a one-thread executor) keeps looking "
    "for more, yielding its core between looks, before it sleeps. Saves a wake-up per handoff "
    "on a task's round trip (each costs tens of microseconds where idle cores halt, as in "
    "virtual machines); costs up to this much CPU after each burst of work. 0: sleep at once.")

TESSERA_SETTING(bool, cache_host_allocations, true, "",
                "Keep freed host buffers for reuse by size. A step graph allocates the same "
                "sizes every step, so this removes malloc/mmap and page faults from the hot "
                "path, at the cost of holding the step's peak memory between steps.")

TESSERA_INT_SETTING(
    inline_object_bytes, 16384, 0, int64_t{16} << 20, "bytes",
    "Objects up to this size travel inside control messages (task results, small "
    "inputs) instead of being pulled over the data plane: lower latency for scalars "
    "and small tensors, more bytes through the scheduler.")

TESSERA_INT_SETTING(trace_instances, 16, 1, 100000, "instances",
                    "Graph instances (training steps) whose per-task spans the scheduler keeps for "
                    "`tessera timeline` and Cluster::Timeline. Memory grows with it: each instance "
                    "keeps about 6 bytes per task and push on each worker.")

TESSERA_INT_SETTING(heartbeat_interval_ms, 500, 10, 60000, "ms",
                    "How often workers report to the scheduler.")

TESSERA_INT_SETTING(
    scheduler_grace_ms, 30000, 0, 86400000, "ms",
    "How long a worker that lost its scheduler (closed connection, or silent for "
    "heartbeat_timeout_ms) keeps trying to join it again, a restarted one, before it "
    "exits and frees its memory. 0: exit at once.")

TESSERA_INT_SETTING(heartbeat_timeout_ms, 3000, 100, 3600000, "ms",
                    "A worker silent this long is declared dead (a closed connection is noticed at "
                    "once). Lower detects hangs sooner; too low declares slow workers dead.")

TESSERA_SETTING(std::string, data_host, "", "",
                "The IP address a worker's or driver's data plane listens on and advertises to "
                "its peers. Empty: the address this host uses to reach the scheduler (loopback "
                "for a local one; the interface's address toward another host, which is what "
                "peers on other hosts can reach).")

TESSERA_INT_SETTING(
    data_chunk_bytes, 8388608, 4096, int64_t{1} << 30, "bytes",
    "Data-plane pulls move in chunks of this size, several in flight, so sending and "
    "receiving overlap.")

TESSERA_INT_SETTING(
    pull_timeout_ms, 30000, 100, 86400000, "ms",
    "A data-plane pull with no progress for this long fails (the peer is treated as "
    "dead), so transfers never hang.")

TESSERA_SETTING(std::string, swap_dir, "", "",
                "A directory for the disk tier: each CPU worker (and an in-process run) makes "
                "an unlinked swap file there, where the memory plan may swap activations its "
                "host cap cannot hold (with a disk link: --disk-link-gbps, or measured). Put it "
                "on a local NVMe drive. Empty: no disk tier.")

TESSERA_SETTING(std::string, cache_dir, "", "",
                "Where measurements worth keeping between runs go (the plan search's "
                "calibrations: training/plan_calibration.h). Empty: $XDG_CACHE_HOME/tessera, "
                "else ~/.cache/tessera.")

TESSERA_SETTING(std::string, temp_dir, "", "",
                "Where this host's cluster sessions go (each a directory of the token, the "
                "scheduler's address, every process's log and spill): `tessera start`, a "
                "driver's local cluster, and the commands that find the latest session without "
                "--address. --temp-dir on tessera and the drivers sets it. Empty: "
                "/tmp/tessera-<user>, each user's own, so two users of a host never share one.")

TESSERA_SETTING(std::string, log_level, "info", "",
                "spdlog level for every component: trace, debug, info, warn, error, off.")

TESSERA_INT_SETTING(
    collective_timeout_ms, 30000, 100, 86400000, "ms",
    "A collective whose peer stays silent this long fails on every member, naming "
    "the silent peer (a dead peer is reported at once). Lower notices stuck workers "
    "sooner; too low fails collectives behind a slow member.")

TESSERA_INT_SETTING(
    collective_chunk_bytes, 1048576, 1024, int64_t{1} << 30, "bytes",
    "Ring collectives move each segment in chunks of this size, so reducing one chunk "
    "overlaps receiving the next. Smaller pipelines better, larger costs fewer "
    "messages.")

TESSERA_INT_SETTING(
    collective_small_bytes, 65536, 0, int64_t{1} << 30, "bytes",
    "All-reduces, reduce-scatters and broadcasts of buffers up to this size use the direct "
    "algorithm (one hop, every rank sends to every other, reductions in rank order: the "
    "same bits whatever the segmentation) instead of the ring: lower latency, more bytes.")

TESSERA_INT_SETTING(
    collective_spin_us, 500, 0, 100000, "us",
    "How long a worker's collective, waiting for its peers' messages, keeps polling (yielding "
    "its core to any other runnable thread between polls) before it sleeps. Saves a wake-up "
    "on each step of a collective whose peers come within it (tens of microseconds each where "
    "idle cores halt, as in virtual machines); costs up to this much otherwise idle CPU per "
    "wait. 0: sleep at once.")

TESSERA_INT_SETTING(
    collective_single_copy_bytes, 0, 0, int64_t{1} << 40, "bytes",
    "Collective messages from this size to ranks on the same host are read once straight "
    "out of the sender's memory instead of passing through UCX's shared memory, whose "
    "handshakes need both ranks running at once. 0: 64 KiB, or 8 KiB where the group's "
    "ranks on the host outnumber its cores (a local cluster whose workers' threads "
    "outnumber the cores sets 8193). Lower helps ranks that take turns on cores; higher "
    "suits ranks with cores of their own.")

TESSERA_INT_SETTING(
    dashboard_port, 0, -1, 65535, "port",
    "The scheduler's web dashboard, its JSON API and /metrics listen on this TCP port "
    "at the scheduler's host address, guarded by the cluster token. 0: any free port "
    "(written to <session>/dashboard.address; `tessera start --head` prints the URL). "
    "-1: no dashboard. `--dashboard-port` overrides it.")

TESSERA_INT_SETTING(
    preauth_deadline_ms, 5000, 100, 600000, "ms",
    "A connection that has not proved the cluster token this long after it was "
    "accepted is closed: the scheduler's control connections (Hello), data-plane "
    "endpoints (the token handshake); the dashboard closes a connection that has not "
    "sent a whole request within it. Lower sheds idle strangers sooner; too low "
    "refuses peers on a slow or loaded network.")

TESSERA_INT_SETTING(
    preauth_frame_bytes, 65536, 1024, 268435456, "bytes",
    "The largest control-plane frame the scheduler buffers from a connection before "
    "its Hello was accepted (Hello is well under 1 KiB); after it, frames up to "
    "256 MiB. A bigger one closes that connection.")

TESSERA_INT_SETTING(
    preauth_max_pending, 512, 1, 1000000, "connections",
    "Connections still proving the token (or, on the dashboard, waiting for a "
    "request), in all, per listener: the scheduler, each data plane, the dashboard. "
    "At the cap the oldest is closed to make room for a new one, so a flood cannot "
    "lock others out. Keep it well under the file-descriptor limit (ulimit -n).")

TESSERA_INT_SETTING(preauth_max_pending_per_address, 64, 1, 1000000, "connections",
                    "The same cap per peer IP address (all local Unix-socket peers count as one): "
                    "one host's flood displaces its own oldest connections first.")

// ---- What one control-plane message may hold (core/rpc/wire_limits.h) ----
// Every count, size, rank and index read off the wire is checked against these before anything
// is allocated or indexed by it; a message over a limit is refused (InvalidArgument naming the
// field, its value and the limit) and its sender disconnected, and the scheduler goes on
// serving everyone else. Higher admits bigger graphs; each also bounds what one hostile message
// can make the scheduler allocate.

TESSERA_INT_SETTING(wire_max_tasks, 262144, 1, int64_t{1} << 24, "tasks",
                    "Tasks in one message (a SubmitTasks batch, a registered graph, a graph part), "
                    "and names in a RunGraph. A GPT-2 step graph has a few thousand.")

TESSERA_INT_SETTING(wire_max_objects, 1048576, 1, int64_t{1} << 26, "objects",
                    "Entries of any one list of objects or ids in a message (a graph's objects, a "
                    "Put, a release, a run's bindings, a task's inputs and outputs, spans of a "
                    "report).")

TESSERA_INT_SETTING(wire_max_group_size, 4096, 1, 4096, "members",
                    "Members of one collective (its group_size attribute). At most 4096, the most "
                    "any cluster of Tessera's kind holds (core/collective_task.h).")

TESSERA_INT_SETTING(wire_max_tensor_bytes, 1099511627776, 1, int64_t{1} << 50, "bytes",
                    "Bytes of one object (its shape's elements times its dtype's size) as declared "
                    "on the wire. 1 TiB by default: far above any one object's tier.")

TESSERA_INT_SETTING(
    wire_max_attr_bytes, 16777216, 1024, int64_t{1} << 30, "bytes",
    "Bytes of one task attribute's value (a text, or 8 per entry of a list of ints), "
    "and of one error text, collective address blob or plugin library.")

TESSERA_SETTING(bool, allow_plugins, true, "",
                "Whether the scheduler accepts drivers' plugins (shared libraries of ops and "
                "kernels that every worker loads and runs: ops/plugin.h). A token holder can "
                "then run native code on every worker; false refuses them, naming this setting.")

TESSERA_INT_SETTING(
    wire_max_name_bytes, 4096, 64, int64_t{1} << 20, "bytes",
    "Bytes of one name on the wire: tasks, objects, layers, ops, attributes, hosts, "
    "addresses, jobs, the token.")
