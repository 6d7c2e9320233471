// Every Tessera setting, declared once: type, name, default, unit, and what it trades off.
// Included by settings.h/settings.cc with TESSERA_SETTING defined; do not include elsewhere.
// Each can be overridden by the environment variable TESSERA_<NAME IN CAPITALS>.
//
// TESSERA_SETTING(type, name, default, unit, description)

TESSERA_SETTING(int64_t, cpu_threads, 0, "threads",
                "Threads in the CPU executor's TBB arena (kernels and independent tasks share "
                "them). 0 means one per core. More than the cores only adds contention.")

TESSERA_SETTING(int64_t, gemm_split_min_flops, 4000000, "flop",
                "GEMMs smaller than this run on one thread; larger ones are split across the "
                "arena. Lower splits more small GEMMs (more overhead per split).")

TESSERA_SETTING(bool, cache_host_allocations, true, "",
                "Keep freed host buffers for reuse by size. A step graph allocates the same "
                "sizes every step, so this removes malloc/mmap and page faults from the hot "
                "path, at the cost of holding the step's peak memory between steps.")

TESSERA_SETTING(int64_t, inline_object_bytes, 16384, "bytes",
                "Objects up to this size travel inside control messages (task results, small "
                "inputs) instead of being pulled over the data plane: lower latency for scalars "
                "and small tensors, more bytes through the scheduler.")

TESSERA_SETTING(int64_t, trace_instances, 16, "instances",
                "Graph instances (training steps) whose per-task spans the scheduler keeps for "
                "`tessera timeline` and Cluster::Timeline. Memory grows with it: each instance "
                "keeps about 40 bytes per task and push on each worker.")

TESSERA_SETTING(int64_t, heartbeat_interval_ms, 500, "ms",
                "How often workers report to the scheduler.")

TESSERA_SETTING(int64_t, scheduler_grace_ms, 30000, "ms",
                "How long a worker that lost its scheduler (closed connection, or silent for "
                "heartbeat_timeout_ms) keeps trying to join it again, a restarted one, before it "
                "exits and frees its memory. 0: exit at once.")

TESSERA_SETTING(int64_t, heartbeat_timeout_ms, 3000, "ms",
                "A worker silent this long is declared dead (a closed connection is noticed at "
                "once). Lower detects hangs sooner; too low declares slow workers dead.")

TESSERA_SETTING(std::string, data_host, "", "",
                "The IP address a worker's or driver's data plane listens on and advertises to "
                "its peers. Empty: the address this host uses to reach the scheduler (loopback "
                "for a local one; the interface's address toward another host, which is what "
                "peers on other hosts can reach).")

TESSERA_SETTING(int64_t, data_chunk_bytes, 8388608, "bytes",
                "Data-plane pulls move in chunks of this size, several in flight, so sending and "
                "receiving overlap.")

TESSERA_SETTING(int64_t, pull_timeout_ms, 30000, "ms",
                "A data-plane pull with no progress for this long fails (the peer is treated as "
                "dead), so transfers never hang.")

TESSERA_SETTING(std::string, log_level, "info", "",
                "spdlog level for every component: trace, debug, info, warn, error, off.")

TESSERA_SETTING(int64_t, collective_timeout_ms, 30000, "ms",
                "A collective whose peer stays silent this long fails on every member, naming "
                "the silent peer (a dead peer is reported at once). Lower notices stuck workers "
                "sooner; too low fails collectives behind a slow member.")

TESSERA_SETTING(int64_t, collective_chunk_bytes, 1048576, "bytes",
                "Ring collectives move each segment in chunks of this size, so reducing one chunk "
                "overlaps receiving the next. Smaller pipelines better, larger costs fewer "
                "messages.")

TESSERA_SETTING(int64_t, collective_small_bytes, 65536, "bytes",
                "All-reduces and broadcasts up to this size use the direct algorithm (one hop, "
                "every rank sends to every other) instead of the ring: lower latency, more bytes.")

TESSERA_SETTING(int64_t, dashboard_port, 0, "port",
                "The scheduler's web dashboard, its JSON API and /metrics listen on this TCP port "
                "at the scheduler's host address, guarded by the cluster token. 0: any free port "
                "(written to <session>/dashboard.address; `tessera start --head` prints the URL). "
                "-1: no dashboard. `--dashboard-port` overrides it.")

TESSERA_SETTING(int64_t, preauth_deadline_ms, 5000, "ms",
                "A connection that has not proved the cluster token this long after it was "
                "accepted is closed: the scheduler's control connections (Hello), data-plane "
                "endpoints (the token handshake); the dashboard closes a connection that has not "
                "sent a whole request within it. Lower sheds idle strangers sooner; too low "
                "refuses peers on a slow or loaded network.")

TESSERA_SETTING(int64_t, preauth_frame_bytes, 65536, "bytes",
                "The largest control-plane frame the scheduler buffers from a connection before "
                "its Hello was accepted (Hello is well under 1 KiB); after it, frames up to "
                "256 MiB. A bigger one closes that connection.")

TESSERA_SETTING(int64_t, preauth_max_pending, 512, "connections",
                "Connections still proving the token (or, on the dashboard, waiting for a "
                "request), in all, per listener: the scheduler, each data plane, the dashboard. "
                "At the cap the oldest is closed to make room for a new one, so a flood cannot "
                "lock others out. Keep it well under the file-descriptor limit (ulimit -n).")

TESSERA_SETTING(int64_t, preauth_max_pending_per_address, 64, "connections",
                "The same cap per peer IP address (all local Unix-socket peers count as one): "
                "one host's flood displaces its own oldest connections first.")
