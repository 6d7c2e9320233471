// Child processes of a driver or launcher: the scheduler and workers of a local cluster.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "core/status.h"

namespace tessera {

struct SpawnOptions {
  std::string log_file;         // stdout and stderr go here (appended); empty: inherit
  bool die_with_parent = true;  // the child is killed if this process dies (even by a crash)
  bool new_session = false;     // detach from the terminal (daemons started by `tessera start`)
};

// Starts argv[0] with the arguments. Unavailable naming the program when it cannot start.
Result<pid_t> SpawnProcess(const std::vector<std::string>& argv, const SpawnOptions& options);

// Sends SIGTERM, waits up to timeout_ms, then SIGKILL. Returns once the process is gone.
void StopProcess(pid_t pid, int timeout_ms);

// True while the process exists (and, for a child, has not been reaped).
bool ProcessAlive(pid_t pid);

// Path of the running executable's directory.
std::string ExecutableDirectory();

// 32 random bytes as hex, from /dev/urandom.
Result<std::string> RandomToken();

}  // namespace tessera
