// LocalSession: the one way Tessera starts a cluster's processes on this host. `tessera start`
// (daemons that outlive the command) and Cluster::StartLocal (children that die with the driver)
// both go through it, so a cluster started either way looks the same on disk and fails the same
// way.
//
// A session is a directory (under the session root unless one is given) holding
//   token              the cluster token, 0600: every process proves it to join
//   pids               "<name> <pid>" for every process it started (the scheduler, workers):
//                      whether the session still runs
//   scheduler.address  the scheduler's HOST:PORT, written by the scheduler once it listens
//   scheduler.sock     its Unix socket (processes on this host join over it)
//   scheduler.pid      its pid
//   dashboard.address  the HOST:PORT of the scheduler's dashboard, when it has one
//   scheduler.log, worker-<tag>.log, spill-<tag>/   what each process printed, and spilled
//   worker<N>.log      a link to the log of the worker the scheduler calls worker<N> (made by
//                      the worker once it joined: the names `tessera status` shows)
// The session root is the temp_dir setting ($TESSERA_TEMP_DIR; --temp-dir on tessera and the
// drivers), else /tmp/tessera-<user>: each user's own (0700), so two users of a host never share
// a session or its tokens. `tessera start --head`, and a driver's local cluster while it runs,
// link their session as <root>/session_latest, which commands without --address use. A new
// session removes the sessions under the root whose processes have all exited, but the newest
// kKeptEndedSessions of them (their logs, to read after the fact).
//
// Start-up never hangs: each wait has a deadline, and a process that exits while starting is
// reported with the end of its log.
//
// Thread safety: a LocalSession is used from one thread.
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

#include "core/status.h"

namespace tessera {

inline constexpr int kKeptEndedSessions = 5;

// The session root for the temp_dir setting `temp_dir` (above).
std::string SessionRoot(const std::string& temp_dir);
// <SessionRoot(temp_dir)>/session_latest.
std::string LatestSession(const std::string& temp_dir);

// The scheduler's address: `flag` when given, else the latest session's (NotFound saying how to
// start one when there is none).
Result<std::string> SchedulerAddressOrLatest(const std::string& flag, const std::string& temp_dir);
// The cluster token file: `flag` when given, else the latest session's.
std::string TokenFileOrLatest(const std::string& flag, const std::string& temp_dir);

// Points <root>/session_latest at `dir`, atomically (a new link renamed over the old one).
// Returns the directory it pointed at before (empty when none).
Result<std::string> LinkLatestSession(const std::string& root, const std::string& dir);
// Undoes LinkLatestSession(root, dir) when the link still points at `dir`: back to `previous`
// when that session still runs, else the link is removed. A later session's link is left alone.
void UnlinkLatestSession(const std::string& root, const std::string& dir,
                         const std::string& previous);
// Whether a process the session directory `dir` records (pids, scheduler.pid) still runs.
bool SessionRuns(const std::string& dir);
// Removes the session directories under `root` (those with a token file) whose processes have
// all exited and that were last changed over a minute ago, but the newest `keep` of them; never
// `except`. Returns how many it removed.
int RemoveEndedSessions(const std::string& root, int keep, const std::string& except);

// Where the `tessera` binary (the scheduler and worker processes) may be. FindTesseraBinary
// looks in this order:
//   1. `flag` (LocalClusterOptions::tessera_binary), a path to the binary;
//   2. $TESSERA_BINARY, a path to the binary;
//   3. $TESSERA_BIN_DIR/tessera;
//   4. next to the running executable (every program built inside the project: build/bin);
//   5. the bin directory of the installed SDK the program was built against (find_package
//      (Tessera) adds it to programs that link Tessera::tessera; cmake/TesseraConfig.cmake.in);
//   6. the bin directory of the install prefix Tessera was configured with (CMAKE_INSTALL_PREFIX);
//   7. every directory of $PATH.
// The first three are explicit choices: when one is set and holds no executable, that is the
// error (another binary is not silently used instead). Empty fields are skipped.
struct TesseraBinaryPlaces {
  std::string flag;
  std::string env_binary;   // $TESSERA_BINARY
  std::string env_bin_dir;  // $TESSERA_BIN_DIR
  std::string executable_dir;
  std::string sdk_bin_dir;
  std::string configured_bin_dir;
  std::string path;  // $PATH
  // The places of this process: its environment, its executable, and what it was built with.
  static TesseraBinaryPlaces OfThisProcess(const std::string& flag);
};

// The first executable `tessera` of `places`, in the order above (`is_executable` decides; by
// default access(X_OK) on a regular file). NotFound naming every place tried and how to fix it.
Result<std::string> FindTesseraBinaryIn(
    const TesseraBinaryPlaces& places,
    const std::function<bool(const std::string&)>& is_executable = {});
// FindTesseraBinaryIn(TesseraBinaryPlaces::OfThisProcess(flag)).
Result<std::string> FindTesseraBinary(const std::string& flag);

struct SessionProcesses {
  std::string binary;     // the tessera binary (FindTesseraBinary)
  bool detached = false;  // true: daemons in their own session; false: killed with this process
  std::string temp_dir;   // the temp_dir setting: where a new session goes (SessionRoot)
};

struct SchedulerLaunch {
  std::string host = "127.0.0.1";  // where it listens for TCP (other hosts)
  int port = 0;                    // 0: any free port
  int timeout_ms = 20'000;         // to write its address file
  // Supervised: started again whenever it dies (`tessera scheduler --restart`).
  bool restart = false;
  // The dashboard's port: 0 any free one, -1 none; kDashboardPortFromSettings: the scheduler's
  // dashboard_port setting. Its HOST:PORT goes to <session>/dashboard.address.
  static constexpr int kDashboardPortFromSettings = -2;
  int dashboard_port = kDashboardPortFromSettings;
};

struct StartedScheduler {
  pid_t pid = 0;
  std::string address;        // HOST:PORT, for other hosts
  std::string local_address;  // unix:<session>/scheduler.sock, for this host
  std::string dashboard;      // HOST:PORT of its dashboard; empty when it has none
};

struct WorkerLaunch {
  std::string scheduler;  // the address workers join (a session's local_address on this host)
  int count = 1;
  int threads = 0;  // each; 0: the worker's cores
  int64_t host_memory_mb = 4096;
  double host_cap_gib = 0;  // each worker's allocator cap on its host memory (`--host-cap-gib`)
  std::string tag;          // names logs and spill directories: worker-<tag>-<i>.log
  // GPU workers: worker i owns GPU gpus[i % gpus.size()] (`tessera worker --gpu N`); empty: CPU
  // workers. Several workers may share one GPU (each its own context and allocator cap).
  std::vector<int> gpus;
  double gpu_memory_gib = 0;  // each GPU worker's allocator cap; 0: the GPU's free memory
  // Worker i runs on CPUs cpus[i % cpus.size()] (`tessera worker --cpus`, a list such as "0-3");
  // empty: wherever the system puts it.
  std::vector<std::string> cpus;
  // Variables set in each worker's environment (settings: core/settings_def.h).
  std::vector<std::pair<std::string, std::string>> environment;
};

class LocalSession {
 public:
  // A new session: `dir` (created if missing), or else a fresh directory under
  // SessionRoot(processes.temp_dir) named <prefix>_<time>_<pid>_<random> (ended sessions there
  // removed: RemoveEndedSessions); a new token in it. Unavailable naming the path on failure,
  // and when the default root belongs to another user.
  static Result<LocalSession> Create(const std::string& dir, const std::string& prefix,
                                     SessionProcesses processes);
  // An existing session directory (one with a token file). NotFound naming what is missing.
  static Result<LocalSession> Open(const std::string& dir, SessionProcesses processes);
  // The session for this host's processes of the cluster whose token is in `token_file`: its
  // directory when the file is a session's `token`, else a new session (prefix "node") holding
  // a copy of the token (a worker host given the head's token file).
  static Result<LocalSession> ForToken(const std::string& token_file, SessionProcesses processes);

  const std::string& dir() const { return dir_; }
  const std::string& token() const { return token_; }
  std::string token_file() const { return dir_ + "/token"; }
  std::string address_file() const { return dir_ + "/scheduler.address"; }
  std::string dashboard_file() const { return dir_ + "/dashboard.address"; }

  // Starts the scheduler and waits for its address file. Unavailable (with the end of its log)
  // when it exits first, TimedOut when the deadline passes.
  Result<StartedScheduler> StartScheduler(const SchedulerLaunch& launch);

  // Starts `launch.count` workers; returns their pids at once (see AwaitWorkers).
  Result<std::vector<pid_t>> StartWorkers(const WorkerLaunch& launch);

  // Waits until `count_alive()` (the scheduler's count of alive workers) reaches `target`.
  // Unavailable, with the end of its log, as soon as one of `started` (from StartWorkers with
  // `launch`) has exited; TimedOut naming the count and the logs at the deadline.
  Status AwaitWorkers(const std::function<Result<int>()>& count_alive, int target,
                      const std::vector<pid_t>& started, const WorkerLaunch& launch,
                      int timeout_ms) const;

 private:
  LocalSession(std::string dir, std::string token, SessionProcesses processes)
      : dir_(std::move(dir)), token_(std::move(token)), processes_(std::move(processes)) {}
  std::string WorkerName(const WorkerLaunch& launch, int index) const;
  // Appends "<name> <pid>" to the pids file.
  void RecordProcess(const std::string& name, pid_t pid) const;
  std::vector<std::string> SchedulerArgv(const SchedulerLaunch& launch) const;
  // "; its log ends: ..." with the last lines of `log`, or nothing when it is empty.
  static std::string LogTail(const std::string& log);

  std::string dir_;
  std::string token_;
  SessionProcesses processes_;
};

}  // namespace tessera
