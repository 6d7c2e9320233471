#include "scheduler/scheduler_main.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "core/atomic_file.h"
#include "core/flag_checks.h"
#include "core/logging.h"
#include "core/rpc/address.h"
#include "core/rpc/frame.h"
#include "core/rpc/wire_limits.h"
#include "core/thread_annotations.h"
#include "launcher/process.h"
#include "launcher/process_main.h"
#include "scheduler/scheduler_service.h"

namespace tessera {

namespace {

constexpr const char* kProgram = "tessera";

std::string SelfBinary() { return ExecutableDirectory() + "/tessera"; }

// `tessera scheduler --restart`: runs the scheduler as a child and starts it again, on the same
// port, socket, token and session, whenever it dies (not when it stops cleanly: `tessera stop`).
// The scheduler keeps no state across a restart: workers rejoin it as fresh workers (they retry
// for scheduler_grace_ms), and a driver resumes from its last checkpoint (train_gpt2
// --max-restarts). At most 5 restarts a minute, so a scheduler that cannot start is not
// restarted forever.
int SuperviseScheduler(SchedulerProcessFlags flags) {
  struct Supervision {
    Mutex mutex;
    pid_t child GUARDED_BY(mutex) = 0;
    bool stopping GUARDED_BY(mutex) = false;
  };
  auto state = std::make_shared<Supervision>();  // co-owned by the signal thread
  HandleTerminationSignals([state] {
    MutexLock lock(&state->mutex);
    state->stopping = true;
    if (state->child > 0) ::kill(state->child, SIGTERM);
  });
  std::deque<std::chrono::steady_clock::time_point> restarts;
  for (bool first = true;; first = false) {
    std::vector<std::string> argv = {SelfBinary(),   "scheduler",     "--host",
                                     flags.host,     "--port",        std::to_string(flags.port),
                                     "--token-file", flags.token_file};
    for (const auto& [flag, value] :
         {std::pair<const char*, const std::string&>{"--session-dir", flags.session_dir},
          {"--address-file", flags.address_file},
          {"--unix-socket", flags.unix_socket},
          {"--dashboard-file", flags.dashboard_file}}) {
      if (!value.empty()) argv.insert(argv.end(), {flag, value});
    }
    if (flags.dashboard_port != SchedulerProcessFlags::kDashboardPortFromSettings) {
      argv.insert(argv.end(), {"--dashboard-port", std::to_string(flags.dashboard_port)});
    }
    Result<pid_t> child = SpawnProcess(argv, SpawnOptions{});
    if (!child.ok()) return FailWith(kProgram, child.status());
    {
      MutexLock lock(&state->mutex);
      state->child = *child;
      if (state->stopping) ::kill(*child, SIGTERM);
    }
    if (first && (flags.port == 0 || !flags.dashboard_file.empty()) &&
        !flags.address_file.empty()) {
      // Restarts bind the ports the first scheduler got: workers, drivers and browsers know
      // those. The dashboard's file is written before the address file.
      for (int waited = 0; waited < 20'000 && ProcessAlive(*child); waited += 20) {
        Result<std::string> text = ReadFileTrimmed(flags.address_file);
        Result<rpc::Address> bound =
            text.ok() ? rpc::Address::Parse(*text) : Result<rpc::Address>(text.status());
        if (bound.ok() && bound->port != 0) {
          flags.port = bound->port;
          Result<std::string> dashboard = ReadFileTrimmed(flags.dashboard_file);
          if (dashboard.ok() && dashboard->rfind(':') != std::string::npos) {
            flags.dashboard_port = std::atoi(dashboard->c_str() + dashboard->rfind(':') + 1);
          }
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    int status = 0;
    while (::waitpid(*child, &status, 0) < 0 && errno == EINTR) {
    }
    {
      MutexLock lock(&state->mutex);
      state->child = 0;
      if (state->stopping) return 0;
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return 0;  // stopped cleanly
    const std::string how = WIFSIGNALED(status)
                                ? fmt::format("was killed by signal {}", WTERMSIG(status))
                                : fmt::format("exited with code {}", WEXITSTATUS(status));
    const auto now = std::chrono::steady_clock::now();
    while (!restarts.empty() && now - restarts.front() > std::chrono::minutes(1)) {
      restarts.pop_front();
    }
    if (restarts.size() >= 5) {
      GetLogger("scheduler")
          ->error("the scheduler (pid {}) {}, its 6th death within a minute: not restarting it",
                  *child, how);
      return 1;
    }
    restarts.push_back(now);
    GetLogger("scheduler")
        ->warn("the scheduler (pid {}) {}; starting it again on port {} (workers rejoin it)",
               *child, how, flags.port);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
}

}  // namespace

int RunSchedulerProcess(const SchedulerProcessFlags& flags) {
  if (flags.restart) return SuperviseScheduler(flags);
  Result<Settings> settings = LoadProcessSettings();
  if (!settings.ok()) return FailWith(kProgram, settings.status());
  Result<std::string> token = ReadFileTrimmed(flags.token_file);
  if (!token.ok())
    return FailWith(kProgram, token.status().WithContext("reading the cluster token"));
  SchedulerServiceOptions options;
  options.address = rpc::Address::Tcp(flags.host, static_cast<uint16_t>(flags.port));
  options.address_file = flags.address_file;
  options.unix_socket = flags.unix_socket;
  options.core.token = *token;
  options.core.session_dir = flags.session_dir;
  options.core.heartbeat_interval_ms = static_cast<uint32_t>(settings->heartbeat_interval_ms);
  options.core.heartbeat_timeout_ms = static_cast<uint32_t>(settings->heartbeat_timeout_ms);
  options.core.inline_object_bytes = settings->inline_object_bytes;
  options.core.trace_instances = static_cast<int>(settings->trace_instances);
  options.core.allow_plugins = settings->allow_plugins;
  options.preauth = PendingLimits::FromSettings(*settings);
  options.idle_spin_us = settings->idle_spin_us;
  options.preauth_frame_bytes = static_cast<uint32_t>(
      std::clamp<int64_t>(settings->preauth_frame_bytes, 4096, rpc::kDefaultMaxFrameBytes));
  options.core.limits = rpc::WireLimits::FromSettings(*settings);
  if (Status limits = options.core.limits.Check(); !limits.ok()) return FailWith(kProgram, limits);
  options.dashboard_host = flags.host;
  options.dashboard_port = flags.dashboard_port == SchedulerProcessFlags::kDashboardPortFromSettings
                               ? static_cast<int>(settings->dashboard_port)
                               : flags.dashboard_port;
  options.dashboard_file = flags.dashboard_file;
  // The signal thread and this one both reach the service (races TSan found): through a switch
  // the signal thread co-owns (it may run after this function returned), under its mutex; a
  // signal that comes before the service exists stops it as soon as it does.
  struct StopSwitch {
    Mutex mutex;
    std::shared_ptr<SchedulerService> service GUARDED_BY(mutex);
    bool requested GUARDED_BY(mutex) = false;
  };
  auto stop = std::make_shared<StopSwitch>();
  HandleTerminationSignals([stop] {
    MutexLock lock(&stop->mutex);
    stop->requested = true;
    if (stop->service) stop->service->Stop();
  });
  auto started = SchedulerService::Start(options);
  if (!started.ok()) return FailWith(kProgram, started.status());
  std::shared_ptr<SchedulerService> running = std::move(*started);
  {
    MutexLock lock(&stop->mutex);
    stop->service = running;
    if (stop->requested) running->Stop();
  }
  running->Wait();
  {
    MutexLock lock(&stop->mutex);
    stop->service.reset();
  }
  GetLogger("scheduler")->info("stopped");
  return 0;
}

CLI::App* AddSchedulerCommand(CLI::App& app, SchedulerProcessFlags& flags) {
  CLI::App* command = app.add_subcommand("scheduler", "Run a scheduler in the foreground");
  command->add_option("--host", flags.host);
  command->add_option("--port", flags.port)->check(tessera::Between(0, 65535));
  command->add_option("--token-file", flags.token_file)->required();
  command->add_option("--session-dir", flags.session_dir);
  command->add_option("--address-file", flags.address_file);
  command->add_option("--dashboard-port", flags.dashboard_port,
                      "The dashboard's port (0: any free one; -1: none; default: the "
                      "dashboard_port setting)");
  command->add_option("--dashboard-file", flags.dashboard_file,
                      "Write the dashboard's HOST:PORT here");
  command->add_flag("--restart", flags.restart,
                    "Supervise: start the scheduler again whenever it dies");
  command->add_option("--unix-socket", flags.unix_socket,
                      "Also listen on this Unix socket (local processes)");
  return command;
}

}  // namespace tessera
