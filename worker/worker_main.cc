#include "worker/worker_main.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "core/atomic_file.h"
#include "core/cpu_set.h"
#include "core/flag_checks.h"
#include "core/logging.h"
#include "core/rpc/address.h"
#include "core/session_logs.h"
#include "launcher/process_main.h"
#include "launcher/session.h"
#include "ops/cpu/cpu_kernels.h"
#include "worker/gpu.h"
#include "worker/simulated_gpu.h"
#include "worker/worker_service.h"

namespace tessera {

namespace {
constexpr const char* kProgram = "tessera";
}  // namespace

int RunWorkerProcess(const WorkerProcessFlags& flags) {
  if (!flags.cpus.empty()) {
    // First, so every thread the worker starts runs there too.
    Result<std::vector<int>> cpus = ParseCpuList(flags.cpus);
    Status bound = cpus.ok() ? BindProcessTo(*cpus) : cpus.status();
    if (!bound.ok()) return FailWith(kProgram, bound.WithContext("--cpus"));
  }
  Result<Settings> settings = LoadProcessSettings();
  if (!settings.ok()) return FailWith(kProgram, settings.status());
  Result<std::string> address = SchedulerAddressOrLatest(flags.address, settings->temp_dir);
  if (!address.ok()) return FailWith(kProgram, address.status());
  Result<rpc::Address> parsed = rpc::Address::Parse(*address);
  if (!parsed.ok()) return FailWith(kProgram, parsed.status());
  Result<std::string> token =
      ReadFileTrimmed(TokenFileOrLatest(flags.token_file, settings->temp_dir));
  if (!token.ok())
    return FailWith(kProgram, token.status().WithContext("reading the cluster token"));
  Result<OpRegistry> registry = MakeCpuOpRegistry();
  if (!registry.ok()) return FailWith(kProgram, registry.status());
  WorkerServiceOptions options;
  if (flags.gpu >= 0) {
    // Opened once: a worker that rejoins a restarted scheduler keeps its GPU.
    Result<std::shared_ptr<DeviceRuntime>> gpu =
        OpenGpu(flags.gpu, static_cast<int64_t>(flags.gpu_memory_gib * double(int64_t{1} << 30)));
    if (!gpu.ok())
      return FailWith(kProgram, gpu.status().WithContext(fmt::format("--gpu {}", flags.gpu)));
    if (Status added = AddGpuKernels(*registry); !added.ok()) return FailWith(kProgram, added);
    GetLogger("worker")->info("this worker owns {}", (*gpu)->Describe());
    Result<std::unique_ptr<GpuMeter>> meter = OpenGpuMeter(flags.gpu, *gpu);
    if (meter.ok()) {
      options.gpu_meter = *std::move(meter);
    } else {
      GetLogger("worker")->warn("GPU utilisation will not be reported: {}",
                                meter.status().ToString());
    }
    options.device = *std::move(gpu);
  }
  options.scheduler = *parsed;
  options.token = *token;
  options.threads = flags.threads;
  options.host_capacity_bytes = flags.host_memory_mb << 20;
  options.host_cap_bytes = static_cast<int64_t>(flags.host_cap_gib * double(int64_t{1} << 30));
  options.spill_dir = flags.spill_dir;
  options.settings = *settings;
  // Plugins the scheduler sends are written under the session root (by content, so processes
  // and sessions share them) and added to this process's registry: CPU kernels always, CUDA
  // kernels on a (real) GPU worker.
  std::vector<DeviceKind> plugin_devices{DeviceKind::kCpu};
  if (flags.gpu >= 0 && !SimulatedGpuRequested()) plugin_devices.push_back(DeviceKind::kCuda);
  options.load_plugin = PluginLoader(*registry, std::move(plugin_devices),
                                     SessionRoot(settings->temp_dir) + "/plugins");
  options.data_host = settings->data_host;
  if (options.data_host.empty()) {
    Result<std::string> toward = rpc::LocalHostToward(*parsed);
    if (!toward.ok())
      return FailWith(kProgram, toward.status().WithContext("choosing the data-plane address"));
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
    auto started = WorkerService::Start(options, *registry);
    if (!started.ok()) {
      if (!joined) return FailWith(kProgram, started.status());
      if (std::chrono::steady_clock::now() >= deadline) {
        GetLogger("worker")->warn("exiting: no scheduler at {} within {} ms ({}); the last try: {}",
                                  *address, grace.count(), lost.ToString(),
                                  started.status().ToString());
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      continue;
    }
    joined = true;
    // The log by the id the scheduler gave (`tessera status` shows it): <session>/worker<N>.log.
    if (Status linked = LinkOwnLogAs(fmt::format("worker{}", (*started)->id())); !linked.ok()) {
      GetLogger("worker")->warn("{}", linked.ToString());
    }
    lost = (*started)->Wait();
    if (!lost.ok() && !*interrupted) {
      GetLogger("worker")->warn(
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

CLI::App* AddWorkerCommand(CLI::App& app, WorkerProcessFlags& flags) {
  CLI::App* command = app.add_subcommand("worker", "Run a worker in the foreground");
  command->add_option("--address", flags.address);
  command->add_option("--token-file", flags.token_file);
  command->add_option("--threads", flags.threads)->check(tessera::AtLeast(0));
  command->add_option("--cpus", flags.cpus,
                      "Run only on these CPUs (a list such as 0-3,8; its threads too); default: "
                      "wherever the process may");
  command->add_option("--host-memory-mb", flags.host_memory_mb)->check(tessera::AtLeast(1));
  command
      ->add_option("--host-cap-gib", flags.host_cap_gib,
                   "The cap on the host memory the worker's tasks and objects take at once (a "
                   "step planned with --host-memory-gib fits under the same figure); an "
                   "allocation that would pass it fails its task, naming the cap (0: none)")
      ->check(tessera::AtLeast(0));
  command->add_option("--spill-dir", flags.spill_dir);
  command->add_option("--gpu", flags.gpu, "The GPU this worker owns (-1: a CPU worker)")
      ->check(tessera::Between(-1, 1023));
  command
      ->add_option("--gpu-memory-gib", flags.gpu_memory_gib,
                   "With --gpu: the allocator's cap (0: the GPU's memory)")
      ->check(tessera::AtLeast(0));
  return command;
}

}  // namespace tessera
