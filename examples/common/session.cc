#include "examples/common/session.h"

#include <cstdio>
#include <cstdlib>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "core/logging.h"
#include "training/auto_plan.h"
#include "worker/gpu.h"
#include "worker/swap_file.h"

namespace tessera::examples {

Result<Runtime> OpenRuntime(const CommonFlags& flags) {
  Runtime runtime;
  TESSERA_ASSIGN_OR_RETURN(runtime.settings, Settings::FromProcessEnvironment());
  TESSERA_RETURN_IF_ERROR(SetLogLevel(runtime.settings.log_level).WithContext("TESSERA_LOG_LEVEL"));
  runtime.executor = ExecutorOptions::FromSettings(runtime.settings);
  if (flags.threads > 0) runtime.executor.threads = flags.threads;
  // --device cuda[:N]: the step runs on a GPU (bf16 activations, fp32 master weights and
  // optimizer state): this process's, or with --workers / --address each worker's own (GPU
  // workers: a local cluster's are started on GPU N, or on every GPU in turn for plain cuda).
  Result<Device> device = ParseDevice(flags.device);
  if (!device.ok()) return device.status().WithContext("--device");
  runtime.device = *device;
  runtime.gpu_workers = !runtime.device.is_cpu() && flags.on_cluster();
  if (!runtime.device.is_cpu() && !runtime.gpu_workers) {
    auto gpu =
        OpenGpu(runtime.device.index, static_cast<int64_t>(flags.gpu_memory_gib * (1 << 30)));
    if (!gpu.ok()) return gpu.status().WithContext("--device " + flags.device);
    runtime.executor.device = std::move(*gpu);
  }
  // --swap-dir: this process's swap file (an in-process run's disk tier; the one its disk link is
  // measured on), and the workers' (a local cluster's inherit TESSERA_SWAP_DIR).
  if (!flags.swap_dir.empty()) {
    runtime.settings.swap_dir = flags.swap_dir;
    ::setenv("TESSERA_SWAP_DIR", flags.swap_dir.c_str(), 1);
  }
  // --temp-dir: this process's session root, and its workers' (they inherit TESSERA_TEMP_DIR).
  if (!flags.temp_dir.empty()) {
    runtime.settings.temp_dir = flags.temp_dir;
    ::setenv("TESSERA_TEMP_DIR", flags.temp_dir.c_str(), 1);
  }
  if (!runtime.settings.swap_dir.empty()) {
    SwapFileOptions swap;
    swap.directory = runtime.settings.swap_dir;
    Result<std::shared_ptr<DeviceRuntime>> disk = OpenSwapFile(swap);
    if (!disk.ok()) return disk.status().WithContext("--swap-dir");
    runtime.executor.disk = *std::move(disk);
  }
  return runtime;
}

Session::Session(const CommonFlags& flags, const Runtime& runtime, std::string program)
    : flags_(flags), runtime_(runtime), program_(std::move(program)) {}

Result<std::unique_ptr<Session>> Session::Open(const CommonFlags& flags, const Runtime& runtime,
                                               std::string program) {
  std::unique_ptr<Session> session(new Session(flags, runtime, std::move(program)));
  TESSERA_RETURN_IF_ERROR(session->Start());
  return session;
}

Status Session::Start() {
  if (!flags_.address.empty()) {
    ConnectOptions connect;
    connect.token_file = flags_.token_file;
    TESSERA_ASSIGN_OR_RETURN(cluster_, Cluster::Connect(flags_.address, connect));
    return Status::Ok();
  }
  if (flags_.workers == 0) return Status::Ok();  // in this process
  LocalClusterOptions local;
  local.cpu_workers = flags_.workers;
  if (runtime_.gpu_workers) {
    local.gpu_workers = flags_.workers;
    local.gpus = flags_.device == "cuda" ? "all" : std::to_string(runtime_.device.index);
    local.gpu_memory_gib = flags_.gpu_memory_gib;
  }
  local.threads_per_worker = flags_.threads;
  local.bind_cores = flags_.bind_cores;
  // The plan's host cap is each worker's: their allocators hold the step under it.
  local.host_cap_gib = flags_.host_memory_gib;
  local.temp_dir = runtime_.settings.temp_dir;
  TESSERA_ASSIGN_OR_RETURN(cluster_, Cluster::StartLocal(local));
  std::fprintf(stderr,
               "%s: a local cluster of %d workers at %s (session %s): `tessera status`, "
               "`tessera logs` and `tessera timeline` see it while it runs\n",
               program_.c_str(), flags_.workers, cluster_->address().c_str(),
               cluster_->session_dir().c_str());
  if (!cluster_->dashboard_url().empty()) {
    std::fprintf(stderr, "%s: dashboard %s\n", program_.c_str(), cluster_->dashboard_url().c_str());
  }
  return Status::Ok();
}

ClusterPlacement Session::placement() const {
  return flags_.placement == "layers" ? ClusterPlacement::kLayersRoundRobin
                                      : ClusterPlacement::kScheduler;
}

Result<std::unique_ptr<GraphBackend>> Session::MakeBackend() {
  if (cluster_) return MakeClusterBackend(*cluster_, placement());
  return MakeInProcessBackend(runtime_.executor);
}

Result<Cluster*> Session::Reconnect(int retry_ms) {
  cluster_.reset();
  ConnectOptions connect;
  connect.token_file = flags_.token_file;
  connect.retry_ms = retry_ms;
  auto connected = Cluster::Connect(flags_.address, connect);
  if (!connected.ok()) {
    return connected.status().WithContext(
        fmt::format("the scheduler at {} did not come back within {} ms (a cluster started with "
                    "`tessera start --head` restarts it; one started with --no-restart does not)",
                    flags_.address, retry_ms));
  }
  cluster_ = std::move(*connected);
  return cluster_.get();
}

Status UseTheClustersWorkers(const CommonFlags& flags, Session& session, const ModelSpec& model,
                             const Runtime& runtime, const char* program, TrainingPlan& plan) {
  const ParallelConfig& p = plan.parallel;
  if (flags.address.empty() || flags.workers > 0 || flags.placement == "layers" ||
      session.cluster() == nullptr || p.data_parallel != 1 || p.pipeline_stages != 1 ||
      p.virtual_stages != 1 || !p.workers.empty()) {
    return Status::Ok();
  }
  TESSERA_ASSIGN_OR_RETURN(ClusterInfo info, session.cluster()->Info());
  int alive = 0;
  for (const WorkerInfo& worker : info.workers) {
    alive += worker.alive && (plan.device.is_cpu() || !worker.gpu.empty());
  }
  if (alive <= 1) return Status::Ok();
  Status refused;
  for (int ranks = alive; ranks >= 2; --ranks) {
    TrainingPlan candidate = plan;
    candidate.parallel.data_parallel = ranks;
    const Status valid = candidate.Validate(model);
    if (!valid.ok()) {
      if (refused.ok()) refused = valid;
      continue;
    }
    std::fprintf(stderr,
                 "%s: the cluster at %s has %d %sworkers: training with %d data-parallel ranks, "
                 "one per worker%s (--workers N chooses)\n",
                 program, flags.address.c_str(), alive, plan.device.is_cpu() ? "" : "GPU ", ranks,
                 ranks < alive
                     ? fmt::format(", as many as the batch of {} splits into", plan.batch).c_str()
                     : "");
    const bool profiled = !plan.parallel.layer_op_costs.empty();  // for one rank's rows
    plan = std::move(candidate);
    return profiled ? ApplyBalance(flags, model, runtime.executor, program, plan) : Status::Ok();
  }
  std::fprintf(stderr, "%s: the cluster at %s has %d workers, but the plan keeps one rank: %s\n",
               program, flags.address.c_str(), alive, refused.ToString().c_str());
  return Status::Ok();
}

Status ChooseThePlan(const CommonFlags& flags, Session& session, const ModelSpec& model,
                     const Runtime& runtime, const char* program, TrainingPlan& plan) {
  const PlanSearchFlags& search = flags.search;
  if (search.plan != "auto") return Status::Ok();
  if (flags.placement == "layers") {
    return InvalidArgument(
        "--plan auto chooses among data-parallel, tensor-parallel, spatial, pipeline and ZeRO "
        "plans; --placement layers is a placement of its own: drop one of them");
  }
  AutoPlanOptions options;
  SearchSpace& space = options.space;
  space.workers = std::max(flags.workers, 1);
  std::vector<WorkerId> workers;
  if (session.cluster() != nullptr) {
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<GraphBackend> backend, session.MakeBackend());
    workers = backend->workers();
    if (flags.workers == 0) space.workers = std::max<int>(1, static_cast<int>(workers.size()));
    TESSERA_ASSIGN_OR_RETURN(const ClusterInfo info, session.cluster()->Info());
    options.cluster = info.workers;
  }
  space.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const ParallelConfig& given = plan.parallel;
  if (search.zero_given) space.zero_stages = {given.zero_stage};
  if (search.stages_given) space.pipeline_stages = given.pipeline_stages;
  if (search.micro_given) space.micro_batches = given.micro_batches;
  if (search.schedule_given) space.schedules = {given.schedule};
  if (search.virtual_given) space.virtual_stages = given.virtual_stages;
  if (search.cut_given) space.chunk_layers = given.chunk_layers;
  if (search.tensor_given) space.tensor_parallel = {given.tensor_parallel};
  if (search.sequence_given) space.shard_sequence = {given.shard_sequence};
  // A volume model's --spatial-parallel S (its driver's flag) fixes the slabs.
  if (given.slabs() > 1) space.slabs = {given.slabs()};
  options.cache_dir = DefaultCacheDir(runtime.settings.cache_dir);
  options.recalibrate = search.recalibrate;
  options.calibration_rounds = search.calibration_rounds;
  // The layers are profiled in this process with a local cluster's workers' threads (what the
  // cluster gives each worker), so their times are the workers'.
  ExecutorOptions executor = runtime.executor;
  if (flags.workers > 0 && flags.address.empty()) {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    executor.threads = flags.threads > 0 ? flags.threads : std::max(1, cores / flags.workers);
  }
  options.threads = executor.threads;
  std::fprintf(stderr, "%s: --plan auto: searching the plans of %d worker(s)\n", program,
               space.workers);
  TESSERA_ASSIGN_OR_RETURN(
      AutoPlan chosen,
      ChooseAutoPlan(
          model, plan, options, executor, workers, [&session] { return session.MakeBackend(); },
          [program](const std::string& line) {
            std::fprintf(stderr, "%s: calibrating: %s\n", program, line.c_str());
          }));
  std::fprintf(stderr, "%s: calibration %s\n%s", program, chosen.calibration_source.c_str(),
               DescribeSearch(chosen.search, search.show_plans).c_str());
  std::fprintf(stderr, "%s: --plan auto chose %s\n", program, chosen.why.c_str());
  plan = std::move(chosen.chosen);
  return Status::Ok();
}

std::unique_ptr<StepRecovery> MakeRecovery(const CommonFlags& flags, Session& session,
                                           const Settings& settings, const ModelSpec& model,
                                           const TrainingPlan& plan) {
  const RecoveryFlags& r = flags.recovery;
  if (r.max_restarts <= 0) return nullptr;
  RecoveryOptions options{
      .max_restarts = r.max_restarts,
      .min_workers = r.min_workers,
      // A local cluster gets workers back only if we start them; a running one may get them
      // from its operator.
      .replacement_grace_ms =
          r.replacement_grace_ms >= 0
              ? r.replacement_grace_ms
              : (r.replace_workers ? 30'000 : (flags.address.empty() ? 0 : 10'000)),
      .start_replacements = r.replace_workers,
      .snapshot_every = r.snapshot_every};
  if (!flags.address.empty()) {
    // A lost scheduler: its supervisor (`tessera start --head`) starts it again on the same
    // port; connect to it for as long as workers wait for it (scheduler_grace_ms).
    const int retry_ms = static_cast<int>(settings.scheduler_grace_ms);
    options.reconnect = [&session, retry_ms] { return session.Reconnect(retry_ms); };
  }
  return std::make_unique<StepRecovery>(*session.cluster(), model, plan, session.placement(),
                                        flags.checkpoints.dir, std::move(options));
}

}  // namespace tessera::examples
