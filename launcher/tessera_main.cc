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
//   tessera plan --model gpt2 --batch B --workers N [...]     the best parallel plans, searched
//                                                             on calibrated costs
//                                                             (launcher/plan_command.h)
//
//   tessera logs [scheduler | workerN] [-n LINES] [-f]     the latest session's logs (a list;
//                                                             one of them)
//
// `start --head` creates a session directory (<root>/session_<time>_<pid>_<random>, linked from
// <root>/session_latest; the root is --temp-dir or TESSERA_TEMP_DIR, else /tmp/tessera-<user>:
// launcher/session.h) holding the cluster token (readable only by this user), the scheduler's
// address, and every process's log. Commands without --address use the latest session's
// scheduler; without --token-file, its token.
//
// `tessera scheduler ...` and `tessera worker ...` run one process in the foreground; `start`
// and drivers' local clusters launch these.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include <CLI/CLI.hpp>

#include "client/cluster.h"
#include "client/trace.h"
#include "collectives/nccl_communicator.h"
#include "core/allocator.h"
#include "core/atomic_file.h"
#include "core/cpu_set.h"
#include "core/cuda_device.h"
#include "core/flag_checks.h"
#include "core/logging.h"
#include "core/rpc/address.h"
#include "core/run_main.h"
#include "core/settings.h"
#include "core/transport/ucx_info.h"
#include "core/version.h"
#include "launcher/cluster_config.h"
#include "launcher/launcher.h"
#include "launcher/logs_command.h"
#include "launcher/plan_command.h"
#include "launcher/process.h"
#include "launcher/process_main.h"
#include "launcher/session.h"
#include "launcher/slurm.h"
#include "launcher/ssh_shell.h"
#include "ops/cpu/blas.h"
#include "ops/cpu/cpu_kernels.h"
#include "ops/plugin.h"
#include "scheduler/scheduler_main.h"
#include "worker/gpu.h"
#include "worker/worker_main.h"

#if defined(TESSERA_TBBMALLOC_PROXY)
// malloc is TBB's scalable allocator in this process (TESSERA_MALLOC in CMakeLists.txt).
#include <tbb/tbbmalloc_proxy.h>
#endif

namespace {

using tessera::Result;
using tessera::Status;

using tessera::ReadFileTrimmed;

// How the admin commands (start workers, status, stop) connect: with the cluster token.
tessera::ConnectOptions AdminConnection(const std::string& token_file) {
  tessera::ConnectOptions connect;
  connect.token_file = token_file;
  connect.admin = true;
  return connect;
}

int Fail(const Status& status) { return tessera::FailWith("tessera", status); }

std::string SelfBinary() { return tessera::ExecutableDirectory() + "/tessera"; }

// The temp_dir setting (--temp-dir, else TESSERA_TEMP_DIR): where sessions go. Set once by Main
// after parsing, before any command runs.
std::string temp_dir_setting;  // NOLINT(cppcoreguidelines-avoid-non-const-global-variables)

constexpr int kDashboardPortFromSettings = tessera::SchedulerLaunch::kDashboardPortFromSettings;

// ---- commands ----

struct StartFlags {
  bool head = false;
  std::string host = "127.0.0.1";
  int port = 6380;
  std::string session_dir;
  std::string address;
  int cpu_workers = 1;
  int threads = 0;
  bool bind_cores = false;  // CPU workers each on cores of their own (core/cpu_set.h)
  int64_t host_memory_mb = 4096;
  double host_cap_gib = 0;
  std::string token_file;
  bool cpu_workers_given = false;  // --cpu-workers on the command line (with --gpus: both kinds)
  std::string gpus;
  double gpu_memory_gib = 0;
  bool no_restart = false;
  int dashboard_port = kDashboardPortFromSettings;
  // Stay in the foreground until the started processes exit (what a Slurm step needs:
  // launcher/slurm.h); SIGTERM or SIGINT stops them.
  bool block = false;
};

// Set by SIGTERM or SIGINT while `start --block` holds.
volatile std::sig_atomic_t stop_requested =
    0;  // NOLINT(cppcoreguidelines-avoid-non-const-global-variables)

// Whether process `pid` runs (exists and is no zombie).
bool Runs(pid_t pid) {
  if (::kill(pid, 0) != 0) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  std::getline(stat, text);
  const size_t close = text.rfind(')');
  return close == std::string::npos || close + 2 >= text.size() || text[close + 2] != 'Z';
}

// `start --block`: says so (kBlockingStartedLine, which SrunShell waits for), then waits until
// every process in `pids` exits. SIGTERM or SIGINT (a step cancelled, Ctrl-C) stops them: SIGTERM,
// then SIGKILL to those left after 5 s. Exit 0.
int HoldUntilExit(const std::vector<pid_t>& pids) {
  struct sigaction action {};
  action.sa_handler = [](int) { stop_requested = 1; };
  ::sigemptyset(&action.sa_mask);
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGINT, &action, nullptr);
  std::printf("%s until its %zu process(es) exit (--block; SIGTERM stops them)\n",
              std::string(tessera::launcher::kBlockingStartedLine).c_str(), pids.size());
  std::fflush(stdout);
  const auto any_runs = [&pids] {
    return std::any_of(pids.begin(), pids.end(), [](pid_t pid) { return Runs(pid); });
  };
  while (any_runs()) {
    if (stop_requested != 0) {
      for (pid_t pid : pids) ::kill(pid, SIGTERM);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (any_runs() && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      for (pid_t pid : pids) {
        if (Runs(pid)) ::kill(pid, SIGKILL);
      }
      std::printf("tessera start: stopped its processes (a signal)\n");
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::printf("tessera start: its processes exited\n");
  return 0;
}

int StartHead(const StartFlags& flags, std::vector<pid_t>& started) {
  Result<tessera::LocalSession> session = tessera::LocalSession::Create(
      flags.session_dir, "session",
      {.binary = SelfBinary(), .detached = true, .temp_dir = temp_dir_setting});
  if (!session.ok()) return Fail(session.status());
  Result<tessera::StartedScheduler> scheduler =
      session->StartScheduler({.host = flags.host,
                               .port = flags.port,
                               .timeout_ms = 10'000,
                               .restart = !flags.no_restart,
                               .dashboard_port = flags.dashboard_port});
  if (!scheduler.ok()) return Fail(scheduler.status());
  if (flags.session_dir.empty()) {  // an explicit session dir leaves "latest" alone
    Result<std::string> linked =
        tessera::LinkLatestSession(tessera::SessionRoot(temp_dir_setting), session->dir());
    if (!linked.ok()) {
      std::fprintf(stderr, "tessera: warning: %s\n", linked.status().message().c_str());
    }
  }
  started.push_back(scheduler->pid);
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

int StartWorkers(const StartFlags& flags, std::vector<pid_t>& started) {
  std::vector<int> gpus;
  if (!flags.gpus.empty()) {
    Result<std::vector<int>> resolved = tessera::ResolveGpus(flags.gpus);
    if (!resolved.ok()) return Fail(resolved.status().WithContext("--gpus"));
    gpus = *std::move(resolved);
  }
  Result<std::string> address = tessera::SchedulerAddressOrLatest(flags.address, temp_dir_setting);
  if (!address.ok()) return Fail(address.status());
  Result<tessera::LocalSession> session = tessera::LocalSession::ForToken(
      tessera::TokenFileOrLatest(flags.token_file, temp_dir_setting),
      {.binary = SelfBinary(), .detached = true, .temp_dir = temp_dir_setting});
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
                        .host_cap_gib = flags.host_cap_gib,
                        .tag = tag});
    if (flags.bind_cores) {
      // Each its --threads CPUs (0: this host's CPUs over the workers) in AssignCores's order.
      Result<std::vector<int>> cpus = tessera::ProcessCpus();
      if (!cpus.ok()) return Fail(cpus.status());
      const int each =
          flags.threads > 0
              ? flags.threads
              : std::max(1, static_cast<int>(cpus->size()) / std::max(1, flags.cpu_workers));
      Result<std::vector<std::string>> lists = tessera::WorkerCpuLists(0, flags.cpu_workers, each);
      if (!lists.ok()) return Fail(lists.status());
      launches.back().cpus = *std::move(lists);
    }
  }
  if (!gpus.empty()) {
    launches.push_back({.scheduler = *address,
                        .count = static_cast<int>(gpus.size()),
                        .threads = flags.threads,
                        .host_memory_mb = flags.host_memory_mb,
                        .host_cap_gib = flags.host_cap_gib,
                        .tag = tag + "-gpu",
                        .gpus = gpus,
                        .gpu_memory_gib = flags.gpu_memory_gib});
  }
  for (const tessera::WorkerLaunch& launch : launches) {
    Result<tessera::ClusterInfo> before = (*admin)->Info();
    if (!before.ok()) return Fail(before.status());
    Result<std::vector<pid_t>> pids = session->StartWorkers(launch);
    if (!pids.ok()) return Fail(pids.status());
    started.insert(started.end(), pids->begin(), pids->end());
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
  Result<std::string> address = tessera::SchedulerAddressOrLatest(address_flag, temp_dir_setting);
  if (!address.ok()) return Fail(address.status());
  auto cluster = tessera::Cluster::Connect(
      *address, AdminConnection(tessera::TokenFileOrLatest(token_file, temp_dir_setting)));
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
  Result<std::string> address = tessera::SchedulerAddressOrLatest(address_flag, temp_dir_setting);
  if (!address.ok()) return Fail(address.status());
  auto cluster = tessera::Cluster::Connect(
      *address, AdminConnection(tessera::TokenFileOrLatest(token_file, temp_dir_setting)));
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
  // cpu: the cores the worker kept busy over its last heartbeat interval; cpus: the CPUs it may
  // run on (a list; bound to cores: its own); gpu%: the part of the GPU's last sample period a
  // kernel ran, and its memory (NVML's: every process on the device).
  std::printf("%-10s %-16s %-8s %-6s %-22s %12s %12s %10s %8s %5s %-9s %8s %10s %5s %21s  %s\n",
              "worker", "host", "pid", "alive", "data plane", "host used", "capacity", "spilled",
              "objects", "cpu", "cpus", "running", "done", "gpu%", "gpu memory", "gpu");
  for (const tessera::WorkerInfo& w : info->workers) {
    std::string gpu_busy = "-", gpu_memory = "-";
    if (w.gpu_use && w.alive) {
      gpu_busy = fmt::format("{:.0f}%", w.gpu_use->utilization * 100);
      gpu_memory = fmt::format("{:.1f} / {:.1f} GiB",
                               static_cast<double>(w.gpu_use->memory_used) / (1 << 30),
                               static_cast<double>(w.gpu_use->memory_total) / (1 << 30));
    }
    std::printf(
        "%-10s %-16s %-8d %-6s %-22s %9.1f MiB %9.1f MiB %6.1f MiB %8lld %5.2f %-9s %8d %10lld "
        "%5s %21s  %s\n",
        w.id.ToString().c_str(), w.hostname.c_str(), w.pid, w.alive ? "yes" : "dead",
        w.data_address.c_str(), static_cast<double>(w.host_used_bytes) / (1 << 20),
        static_cast<double>(w.host_capacity_bytes) / (1 << 20),
        static_cast<double>(w.spilled_bytes) / (1 << 20), static_cast<long long>(w.objects),
        w.cpu_utilization, w.cpus.empty() ? "-" : w.cpus.c_str(), w.tasks_running,
        static_cast<long long>(w.tasks_done), gpu_busy.c_str(), gpu_memory.c_str(),
        w.gpu.empty() ? "-" : w.gpu.c_str());
  }
  return 0;
}

int WriteTimeline(const std::string& address_flag, const std::string& token_file,
                  const std::string& out, int steps) {
  Result<std::string> address = tessera::SchedulerAddressOrLatest(address_flag, temp_dir_setting);
  if (!address.ok()) return Fail(address.status());
  auto cluster = tessera::Cluster::Connect(
      *address, AdminConnection(tessera::TokenFileOrLatest(token_file, temp_dir_setting)));
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
  Result<std::string> address = tessera::SchedulerAddressOrLatest(address_flag, temp_dir_setting);
  if (!address.ok()) return Fail(address.status());
  const tessera::ConnectOptions connect =
      AdminConnection(tessera::TokenFileOrLatest(token_file, temp_dir_setting));
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
  // --slurm: the cluster is this Slurm allocation (launcher/slurm.h), not a file.
  bool slurm = false;
  tessera::launcher::SlurmClusterOptions slurm_options;
};

// What `up`, `down` and `attach` name the cluster by in messages and suggested commands.
std::string ClusterArgument(const ClusterFileFlags& flags) {
  return flags.slurm ? std::string("--slurm") : flags.file;
}

std::string DefaultStateDir() {
  const char* home = std::getenv("HOME");
  return home != nullptr && *home != '\0' ? std::string(home) + "/.tessera/clusters"
                                          : tessera::SessionRoot("") + "/clusters";
}

// "dashboard: http://HOST:PORT/?token=..." for a launched cluster with a dashboard, else "".
std::string DashboardLine(const tessera::launcher::LaunchReport& report) {
  if (report.dashboard.empty()) return std::string();
  Result<std::string> token = tessera::ReadFileTrimmed(report.token_file);
  // The token in the URL is exchanged for a cookie on the first visit.
  return "dashboard: http://" + report.dashboard + "/" +
         (token.ok() ? "?token=" + *token : std::string()) + "\n";
}

// Runs `action` on a Launcher for the flags' cluster file, with ssh and the scheduler probe.
int WithLauncher(const ClusterFileFlags& flags,
                 const std::function<int(tessera::launcher::Launcher&,
                                         const tessera::launcher::ClusterSpec&)>& action) {
  namespace launcher = tessera::launcher;
  Result<launcher::ClusterSpec> spec = tessera::InvalidArgument("no cluster");
  if (flags.slurm) {
    Result<launcher::SlurmAllocation> allocation = launcher::SlurmAllocationFromEnvironment(
        [](const char* name) -> std::optional<std::string> {
          const char* value = std::getenv(name);
          return value != nullptr ? std::optional<std::string>(value) : std::nullopt;
        });
    if (!allocation.ok()) return Fail(allocation.status());
    spec = launcher::SlurmClusterSpec(*allocation, flags.slurm_options);
  } else if (flags.file.empty()) {
    return Fail(tessera::InvalidArgument(
        "name the cluster: a cluster file (.yaml, or a hostfile), or --slurm inside a Slurm "
        "allocation"));
  } else {
    spec = launcher::LoadClusterFile(flags.file);
  }
  if (!spec.ok()) return Fail(spec.status());
  if (!flags.ssh_user.empty()) spec->ssh.user = flags.ssh_user;
  if (!flags.ssh_key.empty()) spec->ssh.key = flags.ssh_key;
  if (!flags.tessera_binary.empty()) spec->tessera_binary = flags.tessera_binary;
  launcher::LauncherOptions options;
  options.state_dir = flags.state_dir.empty() ? DefaultStateDir() : flags.state_dir;
  std::error_code no_path;  // no /proc: only `tessera` on each host's PATH
  options.launcher_binary = std::filesystem::read_symlink("/proc/self/exe", no_path).string();
  std::error_code error;
  std::filesystem::create_directories(options.state_dir, error);
  launcher::SshShell ssh({.ssh = spec->ssh, .known_hosts = options.state_dir + "/known_hosts"});
  launcher::SrunShell srun({.log_dir = options.state_dir});
  launcher::SchedulerProbe probe;
  std::unique_ptr<launcher::LauncherClock> clock = launcher::MakeSteadyClock();
  launcher::Launcher runner(
      *spec, options, flags.slurm ? static_cast<launcher::RemoteShell&>(srun) : ssh, probe, *clock);
  return action(runner, *spec);
}

int Up(const ClusterFileFlags& flags) {
  return WithLauncher(flags, [&](tessera::launcher::Launcher& launcher,
                                 const tessera::launcher::ClusterSpec& spec) {
    const auto started = std::chrono::steady_clock::now();
    Result<tessera::launcher::LaunchReport> report = launcher.Up();
    if (!report.ok()) {
      return Fail(report.status().WithContext("tessera up " + ClusterArgument(flags)));
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::printf("Tessera cluster '%s' at %s (%.1f s)\n%s", spec.name.c_str(),
                report->address.c_str(), seconds, report->Table().c_str());
    std::printf("Drivers: train_gpt2 --address %s --token-file %s ...\n%s", report->address.c_str(),
                report->token_file.c_str(), DashboardLine(*report).c_str());
    if (!report->ok()) {
      std::fprintf(stderr,
                   "tessera: error: some nodes did not come up (above); fix them and run "
                   "`tessera up %s` again: it starts only what is missing\n",
                   ClusterArgument(flags).c_str());
      return 1;
    }
    return 0;
  });
}

int Down(const ClusterFileFlags& flags) {
  return WithLauncher(flags, [&](tessera::launcher::Launcher& launcher,
                                 const tessera::launcher::ClusterSpec& spec) {
    Result<tessera::launcher::LaunchReport> report = launcher.Down();
    if (!report.ok()) {
      return Fail(report.status().WithContext("tessera down " + ClusterArgument(flags)));
    }
    std::printf("Tessera cluster '%s' down\n%s", spec.name.c_str(), report->Table().c_str());
    if (!report->ok()) {
      std::fprintf(stderr,
                   "tessera: error: not every host is clean (above); `tessera down %s` again "
                   "retries\n",
                   ClusterArgument(flags).c_str());
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
        const std::string dashboard = DashboardLine(*report);
        std::fprintf(stderr, "%s# train_gpt2 --address \"$TESSERA_ADDRESS\" ...\n%s%s",
                     report->Table().c_str(), dashboard.empty() ? "" : "# ", dashboard.c_str());
        if (flags.status) return ShowStatus(report->address, report->token_file);
        return 0;
      });
}

// ---- the command line ----

struct StatusFlags {
  std::string address;
  std::string token_file;
  bool waits = false;
};

struct StopFlags {
  std::string address;
  std::string token_file;
};

struct TimelineFlags {
  std::string address;
  std::string token_file;
  std::string out;
  int steps = 2;
};

CLI::App* AddStartCommand(CLI::App& app, StartFlags& start) {
  CLI::App* start_cmd = app.add_subcommand("start", "Start the scheduler (--head) or workers");
  start_cmd->add_flag("--head", start.head, "Start the scheduler of a new cluster");
  start_cmd->add_option("--host", start.host, "Scheduler: address to listen on");
  start_cmd->add_option("--port", start.port, "Scheduler: port (0: any free one)")
      ->check(tessera::Between(0, 65535));
  start_cmd->add_option("--session-dir", start.session_dir, "Scheduler: session directory");
  start_cmd
      ->add_option("--dashboard-port", start.dashboard_port,
                   "--head: the dashboard's port (0: any free one; -1: none; default: the "
                   "dashboard_port setting, 0 unless TESSERA_DASHBOARD_PORT says otherwise)")
      ->check(tessera::Between(-1, 65535));
  start_cmd->add_flag("--no-restart", start.no_restart,
                      "Scheduler: do not start it again when it dies (by default a supervisor "
                      "does, and workers rejoin it)");
  start_cmd->add_flag("--block", start.block,
                      "Stay in the foreground until the started processes exit (SIGTERM or "
                      "SIGINT stops them): for a Slurm step or a container's main process");
  start_cmd->add_option("--address", start.address, "Workers: the scheduler's HOST:PORT");
  start_cmd->add_option("--cpu-workers", start.cpu_workers, "Workers: how many to start")
      ->check(tessera::AtLeast(1));
  start_cmd->add_option("--threads", start.threads, "Workers: threads each (0: all cores)")
      ->check(tessera::AtLeast(0));
  start_cmd->add_flag("--bind-cores", start.bind_cores,
                      "CPU workers: each bound to cores of its own (its --threads CPUs in turn, "
                      "shared evenly when they outnumber the cores; `tessera status` shows them)");
  start_cmd
      ->add_option("--host-memory-mb", start.host_memory_mb,
                   "Workers: host-tier capacity each, beyond which objects spill to disk")
      ->check(tessera::AtLeast(1));
  start_cmd
      ->add_option("--host-cap-gib", start.host_cap_gib,
                   "Workers: the cap on the host memory each one's tasks and objects take at "
                   "once (plan steps for them with --host-memory-gib at most this; 0: none)")
      ->check(tessera::AtLeast(0));
  start_cmd->add_option("--token-file", start.token_file, "Workers: the cluster token file");
  start_cmd->add_option("--gpus", start.gpus,
                        "Workers: start one GPU worker per GPU listed (all, or 0,1,...), instead "
                        "of CPU workers unless --cpu-workers is given too");
  start_cmd
      ->add_option("--gpu-memory-gib", start.gpu_memory_gib,
                   "Workers, with --gpus: each GPU worker's allocator cap (0: the GPU's memory)")
      ->check(tessera::AtLeast(0));
  return start_cmd;
}

CLI::App* AddStatusCommand(CLI::App& app, StatusFlags& flags) {
  CLI::App* status_cmd = app.add_subcommand("status", "Show workers, memory and tasks");
  status_cmd->add_option("--address", flags.address, "The scheduler's HOST:PORT");
  status_cmd->add_option("--token-file", flags.token_file, "The cluster token file");
  status_cmd->add_flag("--waits", flags.waits,
                       "Per worker: the task it runs or what it waits for, and on whom");
  return status_cmd;
}

CLI::App* AddStopCommand(CLI::App& app, StopFlags& flags) {
  CLI::App* stop_cmd = app.add_subcommand("stop", "Stop the cluster (scheduler and workers)");
  stop_cmd->add_option("--address", flags.address, "The scheduler's HOST:PORT");
  stop_cmd->add_option("--token-file", flags.token_file, "The cluster token file");
  return stop_cmd;
}

// up, down and attach: a cluster file and how to reach its hosts.
CLI::App* AddClusterFileCommand(CLI::App& app, const std::string& name,
                                const std::string& description, ClusterFileFlags& flags) {
  CLI::App* command = app.add_subcommand(name, description);
  CLI::Option* file =
      command->add_option("file", flags.file, "The cluster file (.yaml/.yml, or a hostfile)");
  CLI::Option* slurm = command->add_flag(
      "--slurm", flags.slurm,
      "Instead of a file: the Slurm allocation this runs in (salloc, sbatch): the scheduler on "
      "its first node, workers on every node, started with srun");
  file->excludes(slurm);
  tessera::launcher::SlurmClusterOptions& s = flags.slurm_options;
  command->add_option("--port", s.port, "With --slurm: the scheduler's port")
      ->capture_default_str()
      ->check(tessera::Between(1, 65535));
  command
      ->add_option("--workers-per-node", s.workers_per_node,
                   "With --slurm: CPU workers on each node")
      ->capture_default_str()
      ->check(tessera::AtLeast(1));
  command
      ->add_option("--threads", s.threads,
                   "With --slurm: threads of each worker (0: the node's CPUs in the allocation "
                   "over --workers-per-node)")
      ->capture_default_str()
      ->check(tessera::AtLeast(0));
  command->add_option(
      "--session-root", s.session_root,
      "With --slurm: where each node's session directory goes (default /tmp/tessera)");
  command->add_option("--state-dir", flags.state_dir,
                      "Where the launcher keeps <cluster>.json, the token and known_hosts "
                      "(default ~/.tessera/clusters)");
  command->add_option("--ssh-user", flags.ssh_user, "Overrides ssh.user of the file");
  command->add_option("--ssh-key", flags.ssh_key, "Overrides ssh.key of the file");
  command->add_option("--tessera-binary", flags.tessera_binary,
                      "Overrides tessera_binary: the tessera program on the hosts");
  return command;
}

CLI::App* AddTimelineCommand(CLI::App& app, TimelineFlags& flags) {
  CLI::App* timeline_cmd = app.add_subcommand(
      "timeline",
      "Write the last steps' trace (every task, collective and transfer on every "
      "worker) as Chrome/Perfetto JSON");
  timeline_cmd->add_option("--out", flags.out, "The trace file to write (trace.json)")->required();
  timeline_cmd
      ->add_option("--steps", flags.steps,
                   "How many of the latest graph instances (steps) to include (default 2)")
      ->check(tessera::AtLeast(1));
  timeline_cmd->add_option("--address", flags.address, "The scheduler's HOST:PORT");
  timeline_cmd->add_option("--token-file", flags.token_file, "The cluster token file");
  return timeline_cmd;
}

// `start`, once parsed: the scheduler (--head) or workers (of --address, else of the latest
// session).
int Start(const CLI::App& start_cmd, StartFlags& start) {
  std::vector<pid_t> started;
  if (start.head) {
    const int code = StartHead(start, started);
    return code == 0 && start.block ? HoldUntilExit(started) : code;
  }
  std::error_code missing;
  if (start.address.empty() &&
      !std::filesystem::exists(tessera::LatestSession(temp_dir_setting) + "/scheduler.address",
                               missing)) {
    std::fprintf(stderr, "tessera: start needs --head (a scheduler) or --address (workers)\n\n%s",
                 start_cmd.help().c_str());
    return 2;
  }
  start.cpu_workers_given = start_cmd.count("--cpu-workers") > 0;
  const int code = StartWorkers(start, started);
  return code == 0 && start.block ? HoldUntilExit(started) : code;
}

// `tessera doctor`: what this build and machine have, one line each (as DeepSpeed's ds_report):
// the build, the processor and its memory, the BLAS kernels, the GPUs, NCCL, UCX and what plugins
// must match. Exit 0; a settings error is 1.
int Doctor() {
  Result<tessera::Settings> settings = tessera::Settings::FromProcessEnvironment();
  if (!settings.ok()) {
    std::fprintf(stderr, "tessera doctor: %s\n", settings.status().ToString().c_str());
    return 1;
  }
  std::string cpu = "unknown processor";
  {
    std::ifstream info("/proc/cpuinfo");
    for (std::string line; std::getline(info, line);) {
      if (line.starts_with("model name")) {
        const size_t colon = line.find(':');
        if (colon != std::string::npos && colon + 2 <= line.size()) cpu = line.substr(colon + 2);
        break;
      }
    }
  }
  const unsigned cores = std::thread::hardware_concurrency();
  const int threads = settings->cpu_threads;
  std::printf("tessera doctor\n");
  std::printf("  build:   %s\n", tessera::BuildDescription().c_str());
  const std::string executor = threads == 0 ? "one per core" : fmt::format("{}", threads);
  std::printf("  cpu:     %s, %u core(s) online; executor threads: %s (TESSERA_CPU_THREADS=%d)\n",
              cpu.c_str(), cores, executor.c_str(), threads);
  std::printf("  memory:  %.1f GiB physical\n",
              static_cast<double>(tessera::PhysicalHostMemoryBytes()) / (1 << 30));
  std::printf("  blas:    %s\n", tessera::cpu::BlasDescription().c_str());
  const tessera::CudaDevices gpus = tessera::ProbeCudaDevices();
  if (gpus.devices.empty()) {
    std::printf("  gpus:    none usable: %s\n", gpus.reason.c_str());
  }
  for (const tessera::CudaDeviceInfo& gpu : gpus.devices) {
    std::printf("  gpu %d:   %s, %.1f GiB, compute capability %d.%d\n", gpu.index, gpu.name.c_str(),
                static_cast<double>(gpu.total_memory_bytes) / (1 << 30),
                gpu.compute_capability_major, gpu.compute_capability_minor);
  }
  Result<std::string> nccl = tessera::NcclVersion();
  const std::string nccl_text = nccl.ok() ? *nccl : "not loaded: " + nccl.status().message();
  std::printf("  nccl:    %s\n", nccl_text.c_str());
  std::printf("  ucx:     %s\n", tessera::DescribeUcx().c_str());
  // What a plugin must have been built with (ops/plugin.h): a mismatch is refused at load.
  std::printf("  plugins: ABI version %u, type layout %016llx (TESSERA_ALLOW_PLUGINS=%d)\n",
              tessera::kPluginAbiVersion, static_cast<unsigned long long>(tessera::PluginLayout()),
              settings->allow_plugins ? 1 : 0);
  return 0;
}

int Main(int argc, char** argv) {
  CLI::App app{"Tessera: start, stop and inspect a cluster."};
  app.footer("Settings (environment variables):\n" + tessera::Settings::Describe());
  app.require_subcommand(1);
  std::string temp_dir;
  app.add_option("--temp-dir", temp_dir,
                 "Where this host's sessions go and the latest is looked for (the temp_dir "
                 "setting, TESSERA_TEMP_DIR; default /tmp/tessera-<user>); before or after the "
                 "command");
  app.fallthrough();  // the subcommands made below pass --temp-dir up to it
  CLI::App* doctor_cmd = app.add_subcommand(
      "doctor", "Print what this build and machine have: CPU, BLAS kernels, GPUs, NCCL, UCX");

  StartFlags start;
  CLI::App* start_cmd = AddStartCommand(app, start);
  StatusFlags status;
  CLI::App* status_cmd = AddStatusCommand(app, status);
  StopFlags stop;
  CLI::App* stop_cmd = AddStopCommand(app, stop);
  ClusterFileFlags up, down, attach;
  CLI::App* up_cmd = AddClusterFileCommand(
      app, "up",
      "Start the cluster a file describes (or, with --slurm, the Slurm allocation this runs in): "
      "the head, then every node's workers, over ssh (srun steps with --slurm); idempotent "
      "(starts only what is missing); reports each node",
      up);
  CLI::App* down_cmd = AddClusterFileCommand(
      app, "down",
      "Stop the cluster a file (or --slurm: this allocation) describes and check that no process "
      "of it is left",
      down);
  CLI::App* attach_cmd = AddClusterFileCommand(
      app, "attach", "Print TESSERA_ADDRESS/TESSERA_TOKEN_FILE lines for a driver (eval them)",
      attach);
  attach_cmd->add_flag("--status", attach.status, "Also show `tessera status`");
  TimelineFlags timeline;
  CLI::App* timeline_cmd = AddTimelineCommand(app, timeline);
  tessera::PlanCommandFlags plan;
  CLI::App* plan_cmd = tessera::AddPlanCommand(app, plan);
  tessera::LogsCommandFlags logs;
  CLI::App* logs_cmd = tessera::AddLogsCommand(app, logs);

  tessera::SchedulerProcessFlags scheduler;
  CLI::App* scheduler_cmd = tessera::AddSchedulerCommand(app, scheduler);
  tessera::WorkerProcessFlags worker;
  CLI::App* worker_cmd = tessera::AddWorkerCommand(app, worker);

  if (std::optional<int> exit =
          tessera::ParseCommandLine(app, argc, argv, "tessera", tessera::VersionLine("tessera"))) {
    return *exit;
  }
  if (!temp_dir.empty()) {
    ::setenv("TESSERA_TEMP_DIR", temp_dir.c_str(), 1);  // and every process started from here
    temp_dir_setting = temp_dir;
  } else if (Result<tessera::Settings> settings = tessera::Settings::FromProcessEnvironment();
             settings.ok()) {
    temp_dir_setting = settings->temp_dir;  // a bad setting is reported by what reads them
  }
  if (doctor_cmd->parsed()) return Doctor();
  if (logs_cmd->parsed()) return tessera::RunLogsCommand(logs, temp_dir_setting);
  if (start_cmd->parsed()) return Start(*start_cmd, start);
  if (status_cmd->parsed()) {
    return status.waits ? ShowWaits(status.address, status.token_file)
                        : ShowStatus(status.address, status.token_file);
  }
  if (stop_cmd->parsed()) return StopCluster(stop.address, stop.token_file);
  if (up_cmd->parsed()) return Up(up);
  if (down_cmd->parsed()) return Down(down);
  if (attach_cmd->parsed()) return Attach(attach);
  if (timeline_cmd->parsed()) {
    return WriteTimeline(timeline.address, timeline.token_file, timeline.out, timeline.steps);
  }
  if (plan_cmd->parsed()) return tessera::RunPlanCommand(plan);
  if (scheduler_cmd->parsed()) return tessera::RunSchedulerProcess(scheduler);
  if (worker_cmd->parsed()) return tessera::RunWorkerProcess(worker);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::RunMain("tessera", [&] { return Main(argc, argv); });
}
