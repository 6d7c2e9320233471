// Child processes of a driver or launcher: the scheduler and workers of a local cluster.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/status.h"
#include "core/thread_annotations.h"

namespace tessera {

struct SpawnOptions {
  std::string log_file;         // stdout and stderr go here (appended); empty: inherit
  bool die_with_parent = true;  // the child is killed if this process dies (even by a crash)
  bool new_session = false;     // detach from the terminal (daemons started by `tessera start`)
  // Variables set in the child's environment (over this process's, which it inherits).
  std::vector<std::pair<std::string, std::string>> environment;
};

// Starts argv[0] with the arguments. Unavailable naming the program when it cannot start.
Result<pid_t> SpawnProcess(const std::vector<std::string>& argv, const SpawnOptions& options);

// Sends SIGTERM, waits up to timeout_ms, then SIGKILL. Returns once the process is gone.
void StopProcess(pid_t pid, int timeout_ms);

// True while the process exists (and, for a child, has not been reaped).
bool ProcessAlive(pid_t pid);

// ChildReaper: reaps those of this process's children it is given that have exited, every
// `period`, on a thread of its own, so a child that dies while the parent runs on (a local
// cluster's worker killed or crashed) does not stay a zombie until the parent exits. It waits for
// the given pids only (waitpid(pid, WNOHANG) on each): never waitpid(-1) nor a SIGCHLD handler,
// which would take the exit status of children other code waits for. A pid that another waiter
// reaped first (ECHILD) is dropped too.
//
// Thread-safe. The destructor stops the thread and leaves the children still running alone
// (Stop() hands them over first, to stop them).
class ChildReaper {
 public:
  explicit ChildReaper(std::chrono::milliseconds period = std::chrono::milliseconds(200));
  ~ChildReaper();
  ChildReaper(const ChildReaper&) = delete;
  ChildReaper& operator=(const ChildReaper&) = delete;

  // REQUIRES: `pid` is a child of this process.
  void Add(pid_t pid) EXCLUDES(mutex_);
  // The pids given and not reaped yet, in the order given.
  std::vector<pid_t> Children() const EXCLUDES(mutex_);
  // Stops reaping (joins the thread) and returns the pids not reaped, in the order given.
  std::vector<pid_t> Stop() EXCLUDES(mutex_);

 private:
  void Loop() EXCLUDES(mutex_);
  // Reaps the exited ones among pids_.
  void ReapExited() REQUIRES(mutex_);

  const std::chrono::milliseconds period_;
  mutable Mutex mutex_;
  CondVar wake_;
  std::vector<pid_t> pids_ GUARDED_BY(mutex_);
  bool stopping_ GUARDED_BY(mutex_) = false;
  std::thread thread_;
};

// Path of the running executable's directory.
std::string ExecutableDirectory();

// 32 random bytes as hex, from /dev/urandom.
Result<std::string> RandomToken();

}  // namespace tessera
