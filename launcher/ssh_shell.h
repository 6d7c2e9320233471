// The launcher's real side effects: SshShell runs commands on hosts with the OpenSSH client,
// SchedulerProbe asks a running scheduler which workers are alive (launcher.h has the
// interfaces and the orchestration).
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "launcher/launcher.h"

namespace tessera::launcher {

struct SshShellOptions {
  SshSettings ssh;
  // Host keys seen on first contact are remembered here (StrictHostKeyChecking=accept-new), so a
  // changed host key is refused later. Empty: ssh's own ~/.ssh/known_hosts.
  std::string known_hosts;
  std::string ssh_binary = "ssh";
};

// ssh's argv for running `command` on `host` as `user` (empty: options.ssh.user, then ssh's
// default): BatchMode (never a password prompt), ConnectTimeout, the key, the port, the known
// hosts file, ServerAlive probes, then the options of the cluster file.
std::vector<std::string> SshArgv(const SshShellOptions& options, const std::string& host,
                                 const std::string& user, const std::string& command);

// True for hosts that are this machine's loopback ("localhost", 127.x.x.x): the launcher runs
// their commands with the local shell instead of ssh.
bool IsLoopbackHost(const std::string& host);

// Starts argv (looked up on PATH) with `input_fd` as its stdin and `output_fd` as its stdout and
// stderr, in a process group of its own (`new_session`: a session of its own, so it outlives this
// process's terminal). The caller closes its copies of the descriptors. A program that cannot be
// executed exits 127 with "cannot execute the program". Unavailable when fork fails.
Result<pid_t> Spawn(const std::vector<std::string>& argv, int input_fd, int output_fd,
                    bool new_session);
// Writes all of `text` to `fd` (stopping early if the reader is gone), then closes it.
void WriteAllAndClose(int fd, const std::string& text);

// Runs argv with `input` on stdin, stdout and stderr captured together. The child gets its own
// process group, killed (SIGKILL) at the deadline: TimedOut naming argv[0]. Unavailable when it
// cannot be started.
Result<CommandOutcome> RunCapturing(const std::vector<std::string>& argv, const std::string& input,
                                    int timeout_ms);

class SshShell final : public RemoteShell {
 public:
  explicit SshShell(SshShellOptions options) : options_(std::move(options)) {}
  // ssh's exit 255 (it could not connect or authenticate) becomes Unavailable with its words.
  Result<CommandOutcome> Run(const std::string& host, const std::string& user,
                             const std::string& command, const std::string& input,
                             int timeout_ms) override;

 private:
  SshShellOptions options_;
};

// Connects to the scheduler as an administrator each time it is asked; a node's workers are the
// alive ones whose data plane advertises the node's address (or the IPv4 address it resolves to).
class SchedulerProbe final : public ClusterProbe {
 public:
  Result<std::map<std::string, int>> AliveWorkers(const std::string& address,
                                                  const std::string& token,
                                                  const std::vector<std::string>& nodes) override;
};

}  // namespace tessera::launcher
