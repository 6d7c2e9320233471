// tessera: start and stop cluster processes, and look at a running cluster.
//
//   tessera start --head [--host 127.0.0.1] [--port 6380]     the scheduler (runs in background)
//                 [--dashboard-port P]                        and its dashboard (printed URL)
//   tessera start --address HOST:PORT [--cpu-workers N]       N worker processes (background)
//   tessera status [--address HOST:PORT]                      nodes, workers, memory, tasks
//   tessera status --waits                                    per worker: what it runs or waits
//                                                             for, and on whom
//   tessera stop [--address HOST:PORT]                        stops the whole cluster
//   tessera up CLUSTER.yaml | HOSTFILE                        a cluster on hosts over ssh
//   tessera down CLUSTER.yaml                                 stops it; no process left
//   tessera attach CLUSTER.yaml                               where it is, for drivers
//   tessera timeline --out trace.json [--steps N] [--address HOST:PORT]
//                                                             the last N graph instances'
//                                                             spans, as Chrome/Perfetto JSON
//
// `start --head` creates a session directory (/tmp/tessera/session_<time>_<pid>, linked from
// /tmp/tessera/session_latest) holding the cluster token (readable only by this user), the
// scheduler's address, and every process's log. Commands without --address use the latest
// session's scheduler; without --token-file, its token.
//
// `tessera scheduler ...` and `tessera worker ...` run one process in the foreground; `start`
// and drivers' local clusters launch these.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <CLI/CLI.hpp>

#include "core/atomic_file.h"
#include "core/logging.h"
#include "core/rpc/address.h"
#include "core/settings.h"
#include "driver/cluster.h"
#include "driver/gpu.h"
#include "driver/process.h"
#include "driver/session.h"
#include "driver/trace.h"
#include "launcher/cluster_config.h"
#include "launcher/launcher.h"
#include "launcher/ssh_shell.h"
#include "ops/cpu/cpu_kernels.h"
#include "scheduler/scheduler_service.h"
#include "worker/worker_service.h"

namespace {

using tessera::Result;
using tessera::Status;

using tessera::kLatestSession;
using tessera::ReadFileTrimmed;

int Fail(const Status& status) {
  std::fprintf(stderr, "tessera: error: %s\n", status.ToString().c_str());
  return 1;
}

// The scheduler address: the flag, else the latest session's.
Result<std::string> ResolveAddress(const std::string& flag) {
  if (!flag.empty()) return flag;
  Result<std::string> address = ReadFileTrimmed(std::string(kLatestSession) + "/scheduler.address");
  if (!address.ok()) {
    return tessera::NotFound(
        "no --address given and no running session found ({}); start one "
        "with `tessera start --head`",
        kLatestSession);
  }
  return address;
}

std::string DefaultTokenFile(const std::string& flag) {
  return flag.empty() ? std::string(kLatestSession) + "/token" : flag;
}

// How the admin commands (start workers, status, stop) connect: with the cluster token.
tessera::ConnectOptions AdminConnection(const std::string& token_file) {
  tessera::ConnectOptions connect;
  connect.token_file = token_file;
  connect.admin = true;
  return connect;
}

// Blocks SIGINT/SIGTERM in every thread (call before starting any) and runs `on_signal` from a
// dedicated thread when one arrives.
void HandleTerminationSignals(std::function<void()> on_signal) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::thread([signals, on_signal = std::move(on_signal)] {
    int signal = 0;
    sigwait(&signals, &signal);
    on_signal();
  }).detach();
}

// ---- foreground processes ----

// Settings from the environment, with the log level applied.
Result<tessera::Settings> LoadSettings() {
  TESSERA_ASSIGN_OR_RETURN(tessera::Settings settings, tessera::Settings::FromProcessEnvironment());
  TESSERA_RETURN_IF_ERROR(
      tessera::SetLogLevel(settings.log_level).WithContext("TESSERA_LOG_LEVEL"));
  return settings;
}

constexpr int kDashboardPortFromSettings = tessera::SchedulerLaunch::kDashboardPortFromSettings;

struct SchedulerFlags {
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

std::string SelfBinary() { return tessera::ExecutableDirectory() + "/tessera"; }

// `tessera scheduler --restart`: runs the scheduler as a child and starts it again, on the same
// port, socket, token and session, whenever it dies (not when it stops cleanly: `tessera stop`).
// The scheduler keeps no state across a restart: workers rejoin it as fresh workers (they retry
// for scheduler_grace_ms), and a driver resumes from its last checkpoint (train_gpt2
// --max-restarts). At most 5 restarts a minute, so a scheduler that cannot start is not
// restarted forever.
int SuperviseScheduler(SchedulerFlags flags) {
  struct Supervision {
    std::mutex mutex;
    pid_t child = 0;
    bool stopping = false;
  };
  auto state = std::make_shared<Supervision>();  // co-owned by the signal thread
  HandleTerminationSignals([state] {
    std::lock_guard lock(state->mutex);
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
    if (flags.dashboard_port != kDashboardPortFromSettings) {
      argv.insert(argv.end(), {"--dashboard-port", std::to_string(flags.dashboard_port)});
    }
    Result<pid_t> child = tessera::SpawnProcess(argv, tessera::SpawnOptions{});
    if (!child.ok()) return Fail(child.status());
    {
      std::lock_guard lock(state->mutex);
      state->child = *child;
      if (state->stopping) ::kill(*child, SIGTERM);
    }
    if (first && (flags.port == 0 || !flags.dashboard_file.empty()) &&
        !flags.address_file.empty()) {
      // Restarts bind the ports the first scheduler got: workers, drivers and browsers know
      // those. The dashboard's file is written before the address file.
      for (int waited = 0; waited < 20'000 && tessera::ProcessAlive(*child); waited += 20) {
        Result<std::string> text = ReadFileTrimmed(flags.address_file);
        Result<tessera::rpc::Address> bound = text.ok()
                                                  ? tessera::rpc::Address::Parse(*text)
                                                  : Result<tessera::rpc::Address>(text.status());
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
      std::lock_guard lock(state->mutex);
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
      tessera::GetLogger("scheduler")
          ->error("the scheduler (pid {}) {}, its 6th death within a minute: not restarting it",
                  *child, how);
      return 1;
    }
    restarts.push_back(now);
    tessera::GetLogger("scheduler")
        ->warn("the scheduler (pid {}) {}; starting it again on port {} (workers rejoin it)",
               *child, how, flags.port);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
}

int RunScheduler(const SchedulerFlags& flags) {
  if (flags.restart) return SuperviseScheduler(flags);
  Result<tessera::Settings> settings = LoadSettings();
  if (!settings.ok()) return Fail(settings.status());
  Result<std::string> token = ReadFileTrimmed(flags.token_file);
  if (!token.ok()) return Fail(token.status().WithContext("reading the cluster token"));
  tessera::SchedulerServiceOptions options;
  options.address = tessera::rpc::Address::Tcp(flags.host, static_cast<uint16_t>(flags.port));
  options.address_file = flags.address_file;
  options.unix_socket = flags.unix_socket;
  options.core.token = *token;
  options.core.session_dir = flags.session_dir;
  options.core.heartbeat_interval_ms = static_cast<uint32_t>(settings->heartbeat_interval_ms);
  options.core.heartbeat_timeout_ms = static_cast<uint32_t>(settings->heartbeat_timeout_ms);
  options.core.inline_object_bytes = settings->inline_object_bytes;
  options.core.trace_instances = static_cast<int>(settings->trace_instances);
  options.dashboard_host = flags.host;
  options.dashboard_port = flags.dashboard_port == kDashboardPortFromSettings
                               ? static_cast<int>(settings->dashboard_port)
                               : flags.dashboard_port;
  options.dashboard_file = flags.dashboard_file;
  // The signal thread and this one both reach the service (races TSan found): through a switch
  // the signal thread co-owns (it may run after this function returned), under its mutex; a
  // signal that comes before the service exists stops it as soon as it does.
  struct StopSwitch {
    std::mutex mutex;
    std::shared_ptr<tessera::SchedulerService> service;
    bool requested = false;
  };
  auto stop = std::make_shared<StopSwitch>();
  HandleTerminationSignals([stop] {
    std::lock_guard lock(stop->mutex);
    stop->requested = true;
    if (stop->service) stop->service->Stop();
  });
  auto started = tessera::SchedulerService::Start(options);
  if (!started.ok()) return Fail(started.status());
  std::shared_ptr<tessera::SchedulerService> running = std::move(*started);
  {
    std::lock_guard lock(stop->mutex);
    stop->service = running;
    if (stop->requested) running->Stop();
  }
  running->Wait();
  {
    std::lock_guard lock(stop->mutex);
    stop->service.reset();
  }
  tessera::GetLogger("scheduler")->info("stopped");
  return 0;
}

struct WorkerFlags {
  std::string address;
  std::string token_file;
  int threads = 0;
  int64_t host_memory_mb = 4096;
  std::string spill_dir;
  int gpu = -1;  // the GPU this worker owns; -1: a CPU worker
  double gpu_memory_gib = 0;
};

int RunWorker(const WorkerFlags& flags) {
  Result<tessera::Settings> settings = LoadSettings();
  if (!settings.ok()) return Fail(settings.status());
  Result<std::string> address = ResolveAddress(flags.address);
  if (!address.ok()) return Fail(address.status());
  Result<tessera::rpc::Address> parsed = tessera::rpc::Address::Parse(*address);
  if (!parsed.ok()) return Fail(parsed.status());
  Result<std::string> token = ReadFileTrimmed(DefaultTokenFile(flags.token_file));
  if (!token.ok()) return Fail(token.status().WithContext("reading the cluster token"));
  Result<tessera::OpRegistry> registry = tessera::MakeCpuOpRegistry();
  if (!registry.ok()) return Fail(registry.status());
  tessera::WorkerServiceOptions options;
  if (flags.gpu >= 0) {
    // Opened once: a worker that rejoins a restarted scheduler keeps its GPU.
    Result<std::shared_ptr<tessera::DeviceRuntime>> gpu = tessera::OpenGpu(
        flags.gpu, static_cast<int64_t>(flags.gpu_memory_gib * double(int64_t{1} << 30)));
    if (!gpu.ok()) return Fail(gpu.status().WithContext(fmt::format("--gpu {}", flags.gpu)));
    if (Status added = tessera::AddGpuKernels(*registry); !added.ok()) return Fail(added);
    tessera::GetLogger("worker")->info("this worker owns {}", (*gpu)->Describe());
    options.device = *std::move(gpu);
  }
  options.scheduler = *parsed;
  options.token = *token;
  options.threads = flags.threads;
  options.host_capacity_bytes = flags.host_memory_mb << 20;
  options.spill_dir = flags.spill_dir;
  options.settings = *settings;
  options.data_host = settings->data_host;
  if (options.data_host.empty()) {
    Result<std::string> toward = tessera::rpc::LocalHostToward(*parsed);
    if (!toward.ok()) return Fail(toward.status().WithContext("choosing the data-plane address"));
    options.data_host = *toward;
  }
  // Co-owned by the signal thread, which may outlive this function.
  auto interrupted = std::make_shared<std::atomic<bool>>(false);
  HandleTerminationSignals([interrupted] {
    *interrupted = true;
    std::_Exit(0);  // a worker holds no state worth flushing; the scheduler notices it left
  });
  // A worker that loses its scheduler tries to join one at the same address (a restarted one)
  // for scheduler_grace_ms, as a fresh worker: everything it held went with the old scheduler.
  // Then it exits, so a cluster whose scheduler is gone leaves no process holding memory.
  const auto grace = std::chrono::milliseconds(settings->scheduler_grace_ms);
  bool joined = false;
  auto deadline = std::chrono::steady_clock::now();
  Status lost;
  while (true) {
    auto started = tessera::WorkerService::Start(options, *registry);
    if (!started.ok()) {
      if (!joined) return Fail(started.status());
      if (std::chrono::steady_clock::now() >= deadline) {
        tessera::GetLogger("worker")->warn("exiting: no scheduler at {} within {} ms ({})",
                                           *address, grace.count(), lost.ToString());
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      continue;
    }
    joined = true;
    lost = (*started)->Wait();
    if (!lost.ok() && !*interrupted) {
      tessera::GetLogger("worker")->warn(
          "{}; {}", lost.ToString(),
          grace.count() <= 0 ? std::string("exiting")
                             : fmt::format("trying to rejoin for up to {} ms", grace.count()));
    }
    started->reset();  // every thread and object of this incarnation ends here
    if (lost.ok() || *interrupted) return 0;  // told to stop
    if (grace.count() <= 0) return 1;
    deadline = std::chrono::steady_clock::now() + grace;
  }
}

// ---- commands ----

struct StartFlags {
  bool head = false;
  std::string host = "127.0.0.1";
  int port = 6380;
  std::string session_dir;
  std::string address;
  int cpu_workers = 1;
  int threads = 0;
  int64_t host_memory_mb = 4096;
  std::string token_file;
  bool cpu_workers_given = false;  // --cpu-workers on the command line (with --gpus: both kinds)
  std::string gpus;
  double gpu_memory_gib = 0;
  bool no_restart = false;
  int dashboard_port = kDashboardPortFromSettings;
};

int StartHead(const StartFlags& flags) {
  Result<tessera::LocalSession> session = tessera::LocalSession::Create(
      flags.session_dir, "session", {.binary = SelfBinary(), .detached = true});
  if (!session.ok()) return Fail(session.status());
  Result<tessera::StartedScheduler> scheduler =
      session->StartScheduler({.host = flags.host,
                               .port = flags.port,
                               .timeout_ms = 10'000,
                               .restart = !flags.no_restart,
                               .dashboard_port = flags.dashboard_port});
  if (!scheduler.ok()) return Fail(scheduler.status());
  if (flags.session_dir.empty()) {  // an explicit session dir leaves "latest" alone
    std::error_code error;
    std::filesystem::remove(kLatestSession, error);
    std::filesystem::create_directory_symlink(session->dir(), kLatestSession, error);
    if (error) {
      std::fprintf(stderr, "tessera: warning: cannot link %s to the new session: %s\n",
                   kLatestSession, error.message().c_str());
    }
  }
  std::printf("Tessera scheduler started at %s (pid %d)\n", scheduler->address.c_str(),
              scheduler->pid);
  std::printf("  session:    %s (logs, token, address)\n", session->dir().c_str());
  std::printf("  token file: %s (only you can read it)\n", session->token_file().c_str());
  std::printf("  add workers: tessera start --address %s --cpu-workers 2\n",
              scheduler->address.c_str());
  if (!scheduler->dashboard.empty()) {
    // The token in the URL is exchanged for a cookie on the first visit.
    std::printf("  dashboard: http://%s/?token=%s\n", scheduler->dashboard.c_str(),
                session->token().c_str());
  }
  return 0;
}

int StartWorkers(const StartFlags& flags) {
  std::vector<int> gpus;
  if (!flags.gpus.empty()) {
    Result<std::vector<int>> resolved = tessera::ResolveGpus(flags.gpus);
    if (!resolved.ok()) return Fail(resolved.status().WithContext("--gpus"));
    gpus = *std::move(resolved);
  }
  Result<std::string> address = ResolveAddress(flags.address);
  if (!address.ok()) return Fail(address.status());
  Result<tessera::LocalSession> session = tessera::LocalSession::ForToken(
      DefaultTokenFile(flags.token_file), {.binary = SelfBinary(), .detached = true});
  if (!session.ok()) return Fail(session.status());
  auto admin = tessera::Cluster::Connect(*address, AdminConnection(session->token_file()));
  if (!admin.ok()) return Fail(admin.status());
  // CPU workers unless only --gpus was given; GPU workers (one per GPU listed) with --gpus.
  std::vector<tessera::WorkerLaunch> launches;
  const std::string tag = std::to_string(::getpid());
  if (gpus.empty() || flags.cpu_workers_given) {
    launches.push_back({.scheduler = *address,
                        .count = flags.cpu_workers,
                        .threads = flags.threads,
                        .host_memory_mb = flags.host_memory_mb,
                        .tag = tag});
  }
  if (!gpus.empty()) {
    launches.push_back({.scheduler = *address,
                        .count = static_cast<int>(gpus.size()),
                        .threads = flags.threads,
                        .host_memory_mb = flags.host_memory_mb,
                        .tag = tag + "-gpu",
                        .gpus = gpus,
                        .gpu_memory_gib = flags.gpu_memory_gib});
  }
  for (const tessera::WorkerLaunch& launch : launches) {
    Result<tessera::ClusterInfo> before = (*admin)->Info();
    if (!before.ok()) return Fail(before.status());
    Result<std::vector<pid_t>> pids = session->StartWorkers(launch);
    if (!pids.ok()) return Fail(pids.status());
    int alive = 0;
    const Status joined = session->AwaitWorkers(
        [&]() -> Result<int> {
          TESSERA_ASSIGN_OR_RETURN(tessera::ClusterInfo info, (*admin)->Info());
          alive = info.alive_workers();
          return alive;
        },
        before->alive_workers() + launch.count, *pids, launch,
        launch.gpus.empty() ? 10'000 : 60'000);
    if (!joined.ok()) return Fail(joined);
    std::printf("%d %s worker(s) joined %s; %d alive in total. Logs in %s\n", launch.count,
                launch.gpus.empty() ? "CPU" : "GPU", address->c_str(), alive,
                session->dir().c_str());
  }
  return 0;
}

// `tessera status --waits`: one line per worker (tessera::FormatWait).
int ShowWaits(const std::string& address_flag, const std::string& token_file) {
  Result<std::string> address = ResolveAddress(address_flag);
  if (!address.ok()) return Fail(address.status());
  auto cluster = tessera::Cluster::Connect(*address, AdminConnection(DefaultTokenFile(token_file)));
  if (!cluster.ok()) return Fail(cluster.status());
  Result<std::vector<tessera::WorkerWait>> waits = (*cluster)->Waits();
  if (!waits.ok()) return Fail(waits.status());
  if (waits->empty()) std::printf("no workers\n");
  for (const tessera::WorkerWait& wait : *waits) {
    std::printf("%s\n", tessera::FormatWait(wait).c_str());
  }
  return 0;
}

int ShowStatus(const std::string& address_flag, const std::string& token_file) {
  Result<std::string> address = ResolveAddress(address_flag);
  if (!address.ok()) return Fail(address.status());
  auto cluster = tessera::Cluster::Connect(*address, AdminConnection(DefaultTokenFile(token_file)));
  if (!cluster.ok()) return Fail(cluster.status());
  Result<tessera::ClusterInfo> info = (*cluster)->Info();
  if (!info.ok()) return Fail(info.status());
  std::printf("Tessera cluster at %s (session %s)\n", address->c_str(), info->session_dir.c_str());
  std::printf("tasks: %lld queued, %lld running, %lld done; objects: %lld; drivers: %d\n",
              static_cast<long long>(info->tasks_queued),
              static_cast<long long>(info->tasks_running), static_cast<long long>(info->tasks_done),
              static_cast<long long>(info->objects), info->drivers);
  std::map<std::string, std::pair<int, int>> nodes;  // host -> workers alive, total
  for (const tessera::WorkerInfo& w : info->workers) {
    nodes[w.hostname].first += w.alive;
    ++nodes[w.hostname].second;
  }
  for (const auto& [host, counts] : nodes) {
    std::printf("node %s: %d of %d workers alive\n", host.c_str(), counts.first, counts.second);
  }
  std::printf("%-10s %-16s %-8s %-6s %-22s %12s %12s %10s %8s %10s  %s\n", "worker", "host", "pid",
              "alive", "data plane", "host used", "capacity", "spilled", "running", "done", "gpu");
  for (const tessera::WorkerInfo& w : info->workers) {
    std::printf("%-10s %-16s %-8d %-6s %-22s %9.1f MiB %9.1f MiB %6.1f MiB %8d %10lld  %s\n",
                w.id.ToString().c_str(), w.hostname.c_str(), w.pid, w.alive ? "yes" : "no",
                w.data_address.c_str(), static_cast<double>(w.host_used_bytes) / (1 << 20),
                static_cast<double>(w.host_capacity_bytes) / (1 << 20),
                static_cast<double>(w.spilled_bytes) / (1 << 20), w.tasks_running,
                static_cast<long long>(w.tasks_done), w.gpu.empty() ? "-" : w.gpu.c_str());
  }
  return 0;
}

int WriteTimeline(const std::string& address_flag, const std::string& token_file,
                  const std::string& out, int steps) {
  Result<std::string> address = ResolveAddress(address_flag);
  if (!address.ok()) return Fail(address.status());
  auto cluster = tessera::Cluster::Connect(*address, AdminConnection(DefaultTokenFile(token_file)));
  if (!cluster.ok()) return Fail(cluster.status());
  Result<tessera::Timeline> timeline = (*cluster)->Timeline(steps);
  if (!timeline.ok()) return Fail(timeline.status());
  if (timeline->spans.empty()) {
    return Fail(tessera::NotFound(
        "the cluster at {} kept no spans yet: run a graph (a training step) first, or raise "
        "TESSERA_TRACE_INSTANCES on the scheduler",
        *address));
  }
  if (Status written = tessera::WriteChromeTrace(out, *timeline); !written.ok()) {
    return Fail(written);
  }
  std::set<uint64_t> instances;
  for (const tessera::TimelineSpan& span : timeline->spans) instances.insert(span.instance);
  std::printf("wrote %zu spans of %zu graph instance(s) on %zu process(es) to %s\n",
              timeline->spans.size(), instances.size(), timeline->processes.size(), out.c_str());
  return 0;
}

int StopCluster(const std::string& address_flag, const std::string& token_file) {
  Result<std::string> address = ResolveAddress(address_flag);
  if (!address.ok()) return Fail(address.status());
  const tessera::ConnectOptions connect = AdminConnection(DefaultTokenFile(token_file));
  auto cluster = tessera::Cluster::Connect(*address, connect);
  if (!cluster.ok()) return Fail(cluster.status());
  if (Status s = (*cluster)->Shutdown(); !s.ok()) return Fail(s);
  cluster->reset();
  // Wait for the scheduler to stop answering.
  for (int waited = 0; waited < 10'000; waited += 100) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    tessera::ConnectOptions probe = connect;
    probe.timeout_ms = 500;
    if (!tessera::Cluster::Connect(*address, probe).ok()) {
      std::printf("stopped the cluster at %s\n", address->c_str());
      return 0;
    }
  }
  return Fail(
      tessera::TimedOut("the scheduler at {} is still answering 10 s after stop", *address));
}

// ---- up / down / attach (launcher/launcher.h) ----

struct ClusterFileFlags {
  std::string file;
  std::string state_dir;
  std::string ssh_user;
  std::string ssh_key;
  std::string tessera_binary;
  bool status = false;  // attach: also show `tessera status`
};

std::string DefaultStateDir() {
  const char* home = std::getenv("HOME");
  return home != nullptr && *home != '\0' ? std::string(home) + "/.tessera/clusters"
                                          : std::string(tessera::kSessionRoot) + "/clusters";
}

// Runs `action` on a Launcher for the flags' cluster file, with ssh and the scheduler probe.
int WithLauncher(const ClusterFileFlags& flags,
                 const std::function<int(tessera::launcher::Launcher&,
                                         const tessera::launcher::ClusterSpec&)>& action) {
  namespace launcher = tessera::launcher;
  Result<launcher::ClusterSpec> spec = launcher::LoadClusterFile(flags.file);
  if (!spec.ok()) return Fail(spec.status());
  if (!flags.ssh_user.empty()) spec->ssh.user = flags.ssh_user;
  if (!flags.ssh_key.empty()) spec->ssh.key = flags.ssh_key;
  if (!flags.tessera_binary.empty()) spec->tessera_binary = flags.tessera_binary;
  launcher::LauncherOptions options;
  options.state_dir = flags.state_dir.empty() ? DefaultStateDir() : flags.state_dir;
  std::error_code error;
  std::filesystem::create_directories(options.state_dir, error);
  launcher::SshShell shell({.ssh = spec->ssh, .known_hosts = options.state_dir + "/known_hosts"});
  launcher::SchedulerProbe probe;
  std::unique_ptr<launcher::LauncherClock> clock = launcher::MakeSteadyClock();
  launcher::Launcher runner(*spec, options, shell, probe, *clock);
  return action(runner, *spec);
}

int Up(const ClusterFileFlags& flags) {
  return WithLauncher(flags, [&](tessera::launcher::Launcher& launcher,
                                 const tessera::launcher::ClusterSpec& spec) {
    const auto started = std::chrono::steady_clock::now();
    Result<tessera::launcher::LaunchReport> report = launcher.Up();
    if (!report.ok()) return Fail(report.status().WithContext("tessera up " + flags.file));
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::printf("Tessera cluster '%s' at %s (%.1f s)\n%s", spec.name.c_str(),
                report->address.c_str(), seconds, report->Table().c_str());
    std::printf("Drivers: train_gpt2 --address %s --token-file %s ...\n", report->address.c_str(),
                report->token_file.c_str());
    if (!report->ok()) {
      std::fprintf(stderr,
                   "tessera: error: some nodes did not come up (above); fix them and run "
                   "`tessera up %s` again: it starts only what is missing\n",
                   flags.file.c_str());
      return 1;
    }
    return 0;
  });
}

int Down(const ClusterFileFlags& flags) {
  return WithLauncher(flags, [&](tessera::launcher::Launcher& launcher,
                                 const tessera::launcher::ClusterSpec& spec) {
    Result<tessera::launcher::LaunchReport> report = launcher.Down();
    if (!report.ok()) return Fail(report.status().WithContext("tessera down " + flags.file));
    std::printf("Tessera cluster '%s' down\n%s", spec.name.c_str(), report->Table().c_str());
    if (!report->ok()) {
      std::fprintf(stderr,
                   "tessera: error: not every host is clean (above); `tessera down %s` again "
                   "retries\n",
                   flags.file.c_str());
      return 1;
    }
    return 0;
  });
}

int Attach(const ClusterFileFlags& flags) {
  return WithLauncher(
      flags, [&](tessera::launcher::Launcher& launcher, const tessera::launcher::ClusterSpec&) {
        Result<tessera::launcher::LaunchReport> report = launcher.Attach();
        if (!report.ok()) return Fail(report.status());
        // Lines a shell can eval; the table goes to stderr so `eval "$(tessera attach F)"` works.
        std::printf("export TESSERA_ADDRESS=%s\nexport TESSERA_TOKEN_FILE=%s\n",
                    report->address.c_str(), report->token_file.c_str());
        std::fprintf(stderr, "%s# train_gpt2 --address \"$TESSERA_ADDRESS\" ...\n",
                     report->Table().c_str());
        if (flags.status) return ShowStatus(report->address, report->token_file);
        return 0;
      });
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tessera: start, stop and inspect a cluster.\n" + tessera::Settings::Describe()};
  app.require_subcommand(1);

  StartFlags start;
  CLI::App* start_cmd = app.add_subcommand("start", "Start the scheduler (--head) or workers");
  start_cmd->add_flag("--head", start.head, "Start the scheduler of a new cluster");
  start_cmd->add_option("--host", start.host, "Scheduler: address to listen on");
  start_cmd->add_option("--port", start.port, "Scheduler: port (0: any free one)")
      ->check(CLI::Range(0, 65535));
  start_cmd->add_option("--session-dir", start.session_dir, "Scheduler: session directory");
  start_cmd->add_option("--dashboard-port", start.dashboard_port,
                        "--head: the dashboard's port (0: any free one; -1: none; default: the "
                        "dashboard_port setting, 0 unless TESSERA_DASHBOARD_PORT says otherwise)");
  start_cmd->add_flag("--no-restart", start.no_restart,
                      "Scheduler: do not start it again when it dies (by default a supervisor "
                      "does, and workers rejoin it)");
  start_cmd->add_option("--address", start.address, "Workers: the scheduler's HOST:PORT");
  start_cmd->add_option("--cpu-workers", start.cpu_workers, "Workers: how many to start")
      ->check(CLI::PositiveNumber);
  start_cmd->add_option("--threads", start.threads, "Workers: threads each (0: all cores)")
      ->check(CLI::NonNegativeNumber);
  start_cmd
      ->add_option("--host-memory-mb", start.host_memory_mb,
                   "Workers: host-tier capacity each, beyond which objects spill to disk")
      ->check(CLI::PositiveNumber);
  start_cmd->add_option("--token-file", start.token_file, "Workers: the cluster token file");
  start_cmd->add_option("--gpus", start.gpus,
                        "Workers: start one GPU worker per GPU listed (all, or 0,1,...), instead "
                        "of CPU workers unless --cpu-workers is given too");
  start_cmd
      ->add_option("--gpu-memory-gib", start.gpu_memory_gib,
                   "Workers, with --gpus: each GPU worker's allocator cap (0: the GPU's memory)")
      ->check(CLI::NonNegativeNumber);

  std::string status_address, status_token;
  CLI::App* status_cmd = app.add_subcommand("status", "Show workers, memory and tasks");
  status_cmd->add_option("--address", status_address, "The scheduler's HOST:PORT");
  status_cmd->add_option("--token-file", status_token, "The cluster token file");
  bool status_waits = false;
  status_cmd->add_flag("--waits", status_waits,
                       "Per worker: the task it runs or what it waits for, and on whom");

  std::string stop_address, stop_token;
  CLI::App* stop_cmd = app.add_subcommand("stop", "Stop the cluster (scheduler and workers)");
  stop_cmd->add_option("--address", stop_address, "The scheduler's HOST:PORT");
  stop_cmd->add_option("--token-file", stop_token, "The cluster token file");

  ClusterFileFlags up, down, attach;
  const auto cluster_file_options = [](CLI::App* command, ClusterFileFlags& flags) {
    command->add_option("file", flags.file, "The cluster file (.yaml/.yml, or a hostfile)")
        ->required();
    command->add_option("--state-dir", flags.state_dir,
                        "Where the launcher keeps <cluster>.json, the token and known_hosts "
                        "(default ~/.tessera/clusters)");
    command->add_option("--ssh-user", flags.ssh_user, "Overrides ssh.user of the file");
    command->add_option("--ssh-key", flags.ssh_key, "Overrides ssh.key of the file");
    command->add_option("--tessera-binary", flags.tessera_binary,
                        "Overrides tessera_binary: the tessera program on the hosts");
  };
  CLI::App* up_cmd = app.add_subcommand(
      "up",
      "Start the cluster a file describes: the head, then every node's workers over ssh; "
      "idempotent (starts only what is missing); reports each node");
  cluster_file_options(up_cmd, up);
  CLI::App* down_cmd = app.add_subcommand(
      "down", "Stop the cluster a file describes and check that no process of it is left");
  cluster_file_options(down_cmd, down);
  CLI::App* attach_cmd = app.add_subcommand(
      "attach", "Print TESSERA_ADDRESS/TESSERA_TOKEN_FILE lines for a driver (eval them)");
  cluster_file_options(attach_cmd, attach);
  attach_cmd->add_flag("--status", attach.status, "Also show `tessera status`");
  std::string timeline_address, timeline_token, timeline_out;
  int timeline_steps = 2;
  CLI::App* timeline_cmd = app.add_subcommand(
      "timeline",
      "Write the last steps' trace (every task, collective and transfer on every "
      "worker) as Chrome/Perfetto JSON");
  timeline_cmd->add_option("--out", timeline_out, "The trace file to write (trace.json)")
      ->required();
  timeline_cmd
      ->add_option("--steps", timeline_steps,
                   "How many of the latest graph instances (steps) to include (default 2)")
      ->check(CLI::PositiveNumber);
  timeline_cmd->add_option("--address", timeline_address, "The scheduler's HOST:PORT");
  timeline_cmd->add_option("--token-file", timeline_token, "The cluster token file");

  SchedulerFlags scheduler;
  CLI::App* scheduler_cmd = app.add_subcommand("scheduler", "Run a scheduler in the foreground");
  scheduler_cmd->add_option("--host", scheduler.host);
  scheduler_cmd->add_option("--port", scheduler.port)->check(CLI::Range(0, 65535));
  scheduler_cmd->add_option("--token-file", scheduler.token_file)->required();
  scheduler_cmd->add_option("--session-dir", scheduler.session_dir);
  scheduler_cmd->add_option("--address-file", scheduler.address_file);
  scheduler_cmd->add_option("--dashboard-port", scheduler.dashboard_port,
                            "The dashboard's port (0: any free one; -1: none; default: the "
                            "dashboard_port setting)");
  scheduler_cmd->add_option("--dashboard-file", scheduler.dashboard_file,
                            "Write the dashboard's HOST:PORT here");
  scheduler_cmd->add_flag("--restart", scheduler.restart,
                          "Supervise: start the scheduler again whenever it dies");
  scheduler_cmd->add_option("--unix-socket", scheduler.unix_socket,
                            "Also listen on this Unix socket (local processes)");

  WorkerFlags worker;
  CLI::App* worker_cmd = app.add_subcommand("worker", "Run a worker in the foreground");
  worker_cmd->add_option("--address", worker.address);
  worker_cmd->add_option("--token-file", worker.token_file);
  worker_cmd->add_option("--threads", worker.threads)->check(CLI::NonNegativeNumber);
  worker_cmd->add_option("--host-memory-mb", worker.host_memory_mb)->check(CLI::PositiveNumber);
  worker_cmd->add_option("--spill-dir", worker.spill_dir);
  worker_cmd->add_option("--gpu", worker.gpu, "The GPU this worker owns (-1: a CPU worker)")
      ->check(CLI::Range(-1, 1023));
  worker_cmd
      ->add_option("--gpu-memory-gib", worker.gpu_memory_gib,
                   "With --gpu: the allocator's cap (0: the GPU's memory)")
      ->check(CLI::NonNegativeNumber);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "tessera: %s\n\n%s", e.what(), app.help().c_str());
    return 2;
  }
  if (start_cmd->parsed()) {
    if (start.head) return StartHead(start);
    std::error_code missing;
    if (start.address.empty() &&
        !std::filesystem::exists(std::string(kLatestSession) + "/scheduler.address", missing)) {
      std::fprintf(stderr, "tessera: start needs --head (a scheduler) or --address (workers)\n\n%s",
                   start_cmd->help().c_str());
      return 2;
    }
    start.cpu_workers_given = start_cmd->count("--cpu-workers") > 0;
    return StartWorkers(start);
  }
  if (status_cmd->parsed()) {
    return status_waits ? ShowWaits(status_address, status_token)
                        : ShowStatus(status_address, status_token);
  }
  if (stop_cmd->parsed()) return StopCluster(stop_address, stop_token);
  if (up_cmd->parsed()) return Up(up);
  if (down_cmd->parsed()) return Down(down);
  if (attach_cmd->parsed()) return Attach(attach);
  if (timeline_cmd->parsed()) {
    return WriteTimeline(timeline_address, timeline_token, timeline_out, timeline_steps);
  }
  if (scheduler_cmd->parsed()) return RunScheduler(scheduler);
  if (worker_cmd->parsed()) return RunWorker(worker);
  return 2;
}
