// The cluster launcher: `tessera up/down/attach FILE` brings the cluster a ClusterSpec describes
// up on its hosts over ssh, tears it down, and tells a driver how to reach it.
//
// The orchestration is written over three injected side effects, so it is tested without ssh,
// processes or sockets (launcher_test):
//   RemoteShell   runs a shell command on a host (ssh; the local shell for a local head; srun
//                 inside a Slurm allocation: launcher/slurm.h);
//   ClusterProbe  asks the running scheduler how many workers of each node are alive;
//   LauncherClock now and sleep, for the join deadline.
//
// Up, in order:
//   1. The state file (<state_dir>/<name>.json, written atomically, with the cluster token
//      beside it in <name>.token, 0600) says where the head was started. If the probe reaches
//      it with that token, the head is kept; else `tessera start --head` runs on the head host
//      (after the setup commands) and its token is read back with `cat`.
//   2. The probe counts each node's alive workers (by the IP their data plane advertises).
//      A node with all its workers is left alone; the others (in parallel) run the setup
//      commands, then write the token into their session dir from stdin (never on a command
//      line) and run `tessera start --address HEAD --cpu-workers <missing>`, which returns once
//      they joined or says why not.
//   3. It waits, up to join_timeout_s, until every started node has its workers, and reports
//      per node: joined/expected, or the reason (ssh's words when the host is unreachable, the
//      command's exit status and output, "did not join within T").
// So a second `up` of a running cluster starts nothing, and one after a node was lost starts
// only that node's workers.
//
// Down: `tessera stop` through the head (workers are told to exit), then on every host SIGTERM
// and, after 5 s, SIGKILL to every process whose command line names this cluster's session dir
// on that host, and a last pgrep that must find none; reported per host. The state file goes
// once every host is clean.
//
// Thread safety: one call at a time per Launcher; nodes are started from several threads, so
// the RemoteShell must be thread-safe.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "launcher/cluster_config.h"

namespace tessera::launcher {

struct CommandOutcome {
  int exit_code = 0;   // the command's exit status (128+N when killed by signal N)
  std::string output;  // stdout and stderr together
};

class RemoteShell {
 public:
  virtual ~RemoteShell() = default;
  // Runs `command` (POSIX sh) on `host` as `user` (empty: the spec's default), with `input` on
  // its stdin, and returns its exit status and output whatever the status. Unavailable naming
  // the host and the transport's own words when the host cannot be reached (ssh's exit 255);
  // TimedOut when it runs past timeout_ms (it is killed).
  virtual Result<CommandOutcome> Run(const std::string& host, const std::string& user,
                                     const std::string& command, const std::string& input,
                                     int timeout_ms) = 0;
  // Whether the processes a command starts end with it (a Slurm step's do: launcher/slurm.h).
  // Then the launcher runs `tessera start ... --block` through StartBlocking, which returns once
  // they are up and leaves the command running; otherwise (ssh) `tessera start`, whose processes
  // detach, through Run.
  virtual bool StartsBlock() const { return false; }
  virtual Result<CommandOutcome> StartBlocking(const std::string& host, const std::string& user,
                                               const std::string& command, const std::string& input,
                                               int timeout_ms) {
    return Run(host, user, command, input, timeout_ms);
  }
};

class ClusterProbe {
 public:
  virtual ~ClusterProbe() = default;
  // Alive workers per node address (every address of `nodes` present, 0 when none) of the
  // scheduler at `address`, joining with `token`. Unavailable when nothing answers there, or
  // it refuses the token.
  virtual Result<std::map<std::string, int>> AliveWorkers(
      const std::string& address, const std::string& token,
      const std::vector<std::string>& nodes) = 0;
};

class LauncherClock {
 public:
  virtual ~LauncherClock() = default;
  virtual int64_t NowMs() = 0;
  virtual void SleepMs(int64_t ms) = 0;
};
std::unique_ptr<LauncherClock> MakeSteadyClock();

// What `up` and `down` did on one host.
struct HostReport {
  std::string host;
  std::string role;  // "head" or "node"
  int expected = 0;  // workers
  int joined = 0;
  bool ok = false;
  std::string detail;  // "started 2", "kept", or the reason it failed
};

struct LaunchReport {
  std::string address;     // the scheduler's HOST:PORT
  std::string token_file;  // the local copy of the token (for drivers on this machine)
  std::string dashboard;   // the dashboard's HOST:PORT; empty when none
  std::vector<HostReport> hosts;
  bool ok() const;
  // A table: one row per host.
  std::string Table() const;
};

// What the state file records of a running cluster.
struct ClusterState {
  std::string address;
  std::string head_session_dir;
  std::string dashboard;  // the dashboard's HOST:PORT; empty when the scheduler serves none
};

struct LauncherOptions {
  std::string state_dir;                 // holds <name>.json and <name>.token
  int64_t poll_ms = 250;                 // between probes while waiting for workers
  int64_t command_timeout_ms = 120'000;  // any one remote command (setup, start)
  int64_t stop_grace_ms = 5'000;         // SIGTERM to SIGKILL in `down`
  // The tessera program running this launcher (absolute), tried first on every host when the
  // cluster file names no tessera_binary (hosts installed alike, or sharing a file system);
  // empty: only `tessera` on the host's PATH.
  std::string launcher_binary;
};

class Launcher {
 public:
  // The collaborators must outlive the Launcher.
  Launcher(ClusterSpec spec, LauncherOptions options, RemoteShell& shell, ClusterProbe& probe,
           LauncherClock& clock);

  // Brings the cluster up (above). The report says per host what happened: report.ok() when
  // every node has all its workers; otherwise its rows say which failed and why, and the part
  // that came up stays up. An error (Unavailable naming the head and the reason) when the head
  // cannot be started or its token read: then no node was touched.
  Result<LaunchReport> Up();

  // Tears the cluster down (above). report.ok() when every host was reached and runs no
  // process of this cluster; otherwise the rows say which and why, and the state is kept.
  Result<LaunchReport> Down();

  // Where the running cluster is: NotFound when there is no state file, Unavailable when the
  // scheduler does not answer.
  Result<LaunchReport> Attach();

  std::string StatePath() const;
  std::string TokenPath() const;
  // The state file, or NotFound.
  Result<ClusterState> ReadState() const;

 private:
  // Runs a `tessera start` command on `host` (StartsBlock: with --block, through StartBlocking).
  Result<CommandOutcome> StartProcesses(const std::string& host, const std::string& user,
                                        const std::string& start, const std::string& input);
  Result<std::string> StartHead(ClusterState& state);
  HostReport StartNode(const NodeSpec& node, int missing, const std::string& address,
                       const std::string& token);
  HostReport StopHost(const std::string& host, const std::string& user,
                      const std::string& session_dir, const std::string& role);
  std::string Environment(const EnvironmentMap& extra) const;
  // FindTesseraScript for this cluster: the commands that run tessera start with it.
  std::string FindTessera() const;
  Result<CommandOutcome> Setup(const std::string& host, const std::string& user,
                               const EnvironmentMap& extra);

  ClusterSpec spec_;
  LauncherOptions options_;
  RemoteShell& shell_;
  ClusterProbe& probe_;
  LauncherClock& clock_;
};

// Quotes `word` for a POSIX shell ('...' with embedded quotes escaped).
std::string ShellQuote(const std::string& word);

// POSIX shell text that sets $TESSERA_PROGRAM to the tessera program on the host it runs on:
// `named` when the cluster file names one (tessera_binary, --tessera-binary); else `own` (the
// launcher's own path) when it is executable there, else `tessera` on PATH; else it prints what
// it looked for and how to fix it, and exits 127. Ends with "; ".
std::string FindTesseraScript(const std::string& named, const std::string& own);

// The end of `text`: its last `max_chars` characters, trimmed, newlines as " | ".
std::string Tail(const std::string& text, size_t max_chars = 400);

}  // namespace tessera::launcher
