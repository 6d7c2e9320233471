// The scheduler process: `tessera scheduler ...` runs one in the foreground. `tessera start
// --head` and drivers' local clusters (launcher/session.h) launch it with these flags.
//
// RunSchedulerProcess reads the cluster token, starts a SchedulerService (scheduler_service.h)
// with the settings of the environment, and returns when it stops (`tessera stop`, SIGINT or
// SIGTERM). With --restart it supervises instead: it runs the scheduler as a child and starts
// it again, on the same port, socket, token and session, whenever it dies (not when it stops
// cleanly); at most 5 restarts a minute. The scheduler keeps no state across a restart: workers
// rejoin it as fresh workers and a driver resumes from its last checkpoint.
#pragma once

#include <string>

#include "launcher/session.h"

namespace CLI {
class App;
}

namespace tessera {

struct SchedulerProcessFlags {
  static constexpr int kDashboardPortFromSettings = SchedulerLaunch::kDashboardPortFromSettings;
  std::string host = "127.0.0.1";
  int port = 6380;
  std::string token_file;
  std::string session_dir;
  std::string address_file;
  std::string unix_socket;
  // The dashboard's port (0: any free one; -1: none); kDashboardPortFromSettings: the
  // dashboard_port setting. Its HOST:PORT is written to dashboard_file when set.
  int dashboard_port = kDashboardPortFromSettings;
  std::string dashboard_file;
  bool restart = false;  // supervise: run the scheduler as a child, start it again if it dies
};

// Adds the `scheduler` subcommand and its flags to `app`; returns it. `flags` must outlive
// parsing.
CLI::App* AddSchedulerCommand(CLI::App& app, SchedulerProcessFlags& flags);

// Runs the scheduler (or its supervisor) until it stops; the process's exit code.
int RunSchedulerProcess(const SchedulerProcessFlags& flags);

}  // namespace tessera
