// Cluster (client/cluster.h): connecting to a cluster, or starting a local one and adding
// workers to it, and the calls it forwards to its ClusterClient (cluster_client.h).
#include "client/cluster.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "client/cluster_client.h"
#include "core/atomic_file.h"
#include "core/cpu_set.h"
#include "core/logging.h"
#include "core/transport/ucx_peer_transport.h"
#include "launcher/process.h"
#include "launcher/session.h"
#include "worker/gpu.h"

namespace tessera {

ObjectId ObjectRef::id() const { return state_->id; }
const TensorMeta& ObjectRef::meta() const { return state_->meta; }

namespace {

// The temp_dir setting (launcher/session.h): `given`, else $TESSERA_TEMP_DIR, else "".
std::string TempDirSetting(const std::string& given) {
  if (!given.empty()) return given;
  const char* env = std::getenv("TESSERA_TEMP_DIR");
  return env != nullptr ? env : "";
}

Result<std::string> ResolveToken(const ConnectOptions& options) {
  if (!options.token.empty()) return options.token;
  std::string path = options.token_file;
  if (path.empty()) {
    const char* env = std::getenv("TESSERA_TOKEN_FILE");
    path = env != nullptr ? env : LatestSession(TempDirSetting("")) + "/token";
  }
  Result<std::string> token = ReadFileTrimmed(path);
  if (!token.ok() || token->empty()) {
    return Unavailable("no cluster token: pass the token or --token-file (tried '{}')", path);
  }
  return token;
}

}  // namespace

Result<std::unique_ptr<Cluster>> Cluster::Connect(const std::string& address,
                                                  const ConnectOptions& options) {
  TESSERA_ASSIGN_OR_RETURN(std::string token, ResolveToken(options));
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(options.retry_ms);
  while (true) {
    std::unique_ptr<Cluster> cluster(new Cluster());
    cluster->client_ = std::make_shared<detail::ClusterClient>();
    Status joined = cluster->client_->Connect(address, token, options);
    if (joined.ok()) {
      cluster->address_ = address;
      return cluster;
    }
    if (joined.code() != StatusCode::kUnavailable || std::chrono::steady_clock::now() >= deadline) {
      return joined;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
}

namespace {

// How many workers a local cluster starts: its GPU workers, else its CPU workers.
int LocalWorkers(const LocalClusterOptions& options) {
  return options.gpu_workers > 0 ? options.gpu_workers : options.cpu_workers;
}

// `count` more workers of a local cluster like the first ones (GPU workers on `gpus`), `first`
// of them started before (bound to cores: the next ones in AssignCores's order).
Result<WorkerLaunch> LocalLaunch(const LocalClusterOptions& options, const std::vector<int>& gpus,
                                 const std::string& scheduler, int first, int count,
                                 std::string tag) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = options.threads_per_worker > 0
                          ? options.threads_per_worker
                          : std::max(1, cores / std::max(1, LocalWorkers(options)));
  // Workers whose threads outnumber the cores take turns on them: their collectives' messages
  // copy once from a small size on (core/transport/ucx_peer_transport.h), unless the user's
  // environment says otherwise (the workers inherit it).
  std::vector<std::pair<std::string, std::string>> environment;
  constexpr const char* kSingleCopy = "TESSERA_COLLECTIVE_SINGLE_COPY_BYTES";
  if (int64_t{LocalWorkers(options)} * threads > cores && std::getenv(kSingleCopy) == nullptr) {
    environment.emplace_back(kSingleCopy, std::to_string(kOversubscribedSingleCopyBytes));
  }
  std::vector<std::string> cpus;
  if (options.bind_cores) {
    TESSERA_ASSIGN_OR_RETURN(cpus, WorkerCpuLists(first, count, threads));
  }
  return WorkerLaunch{
      .scheduler = scheduler,
      .count = count,
      .threads = threads,
      .host_memory_mb = options.host_capacity_bytes >> 20,
      .host_cap_gib = options.host_cap_gib,
      .tag = std::move(tag),
      .gpus = gpus,
      .gpu_memory_gib = options.gpu_memory_gib,
      .cpus = std::move(cpus),
      .environment = std::move(environment),
  };
}

}  // namespace

Result<std::unique_ptr<Cluster>> Cluster::StartLocal(const LocalClusterOptions& options) {
  const int count = LocalWorkers(options);
  if (count < 1) {
    return InvalidArgument(
        "a local cluster needs at least one worker (cpu_workers = {}, gpu_workers = {})",
        options.cpu_workers, options.gpu_workers);
  }
  std::vector<int> gpus;
  if (options.gpu_workers > 0) {
    Result<std::vector<int>> resolved = ResolveGpus(options.gpus);
    if (!resolved.ok()) {
      return resolved.status().WithContext(
          fmt::format("starting {} GPU worker(s)", options.gpu_workers));
    }
    gpus = *std::move(resolved);
  }
  TESSERA_ASSIGN_OR_RETURN(std::string binary, FindTesseraBinary(options.tessera_binary));
  const std::string temp_dir = TempDirSetting(options.temp_dir);
  TESSERA_ASSIGN_OR_RETURN(
      LocalSession session,
      LocalSession::Create(
          options.session_dir, "local",
          SessionProcesses{.binary = binary, .detached = false, .temp_dir = temp_dir}));
  std::unique_ptr<Cluster> cluster(new Cluster());  // stops what was started if a step fails
  cluster->children_ = std::make_unique<ChildReaper>();
  cluster->session_dir_ = session.dir();
  cluster->local_options_ = options;
  cluster->local_options_.tessera_binary = binary;
  TESSERA_ASSIGN_OR_RETURN(
      StartedScheduler scheduler,
      session.StartScheduler(
          {.host = "127.0.0.1", .port = 0, .timeout_ms = options.start_timeout_ms}));
  cluster->children_->Add(scheduler.pid);
  cluster->address_ = scheduler.address;
  if (options.session_dir.empty()) {
    // `tessera status`, `timeline` and `logs` find this cluster while it runs.
    cluster->latest_root_ = SessionRoot(temp_dir);
    Result<std::string> previous = LinkLatestSession(cluster->latest_root_, session.dir());
    if (previous.ok()) {
      cluster->previous_latest_ = *previous;
    } else {
      cluster->latest_root_.clear();
      GetLogger("client")->warn("{}", previous.status().message());
    }
  }

  // Everything here is on this machine: workers and this driver join over the Unix socket.
  TESSERA_ASSIGN_OR_RETURN(const WorkerLaunch workers,
                           LocalLaunch(options, gpus, scheduler.local_address, 0, count, ""));
  TESSERA_ASSIGN_OR_RETURN(std::vector<pid_t> pids, session.StartWorkers(workers));
  for (pid_t pid : pids) cluster->children_->Add(pid);
  cluster->local_address_ = scheduler.local_address;
  cluster->local_gpus_ = gpus;
  cluster->started_workers_ = count;
  if (!scheduler.dashboard.empty()) {
    cluster->dashboard_url_ =
        fmt::format("http://{}/?token={}", scheduler.dashboard, session.token());
  }

  cluster->client_ = std::make_shared<detail::ClusterClient>();
  ConnectOptions connect;
  connect.token = session.token();
  TESSERA_RETURN_IF_ERROR(
      cluster->client_->Connect(scheduler.local_address, session.token(), connect));
  TESSERA_RETURN_IF_ERROR(session.AwaitWorkers(
      [&]() -> Result<int> {
        TESSERA_ASSIGN_OR_RETURN(ClusterInfo info, cluster->client_->Info(2000));
        return info.alive_workers();
      },
      count, pids, workers, options.start_timeout_ms));
  return cluster;
}

Status Cluster::AddLocalWorkers(int count) {
  if (local_address_.empty()) {
    return InvalidArgument(
        "only a local cluster (Cluster::StartLocal) starts workers; on a running cluster start "
        "them with `tessera start --cpu-workers N --address {}`",
        address_);
  }
  TESSERA_ASSIGN_OR_RETURN(
      LocalSession session,
      LocalSession::Open(session_dir_, SessionProcesses{.binary = local_options_.tessera_binary,
                                                        .detached = false}));
  TESSERA_ASSIGN_OR_RETURN(ClusterInfo before, client_->Info(5000));
  TESSERA_ASSIGN_OR_RETURN(
      const WorkerLaunch workers,
      LocalLaunch(local_options_, local_gpus_, local_address_, started_workers_, count,
                  fmt::format("added{}", started_workers_)));
  started_workers_ += count;
  TESSERA_ASSIGN_OR_RETURN(std::vector<pid_t> pids, session.StartWorkers(workers));
  for (pid_t pid : pids) children_->Add(pid);
  return session.AwaitWorkers(
      [&]() -> Result<int> {
        TESSERA_ASSIGN_OR_RETURN(ClusterInfo info, client_->Info(2000));
        return info.alive_workers();
      },
      before.alive_workers() + count, pids, workers, local_options_.start_timeout_ms);
}

Cluster::~Cluster() {
  if (children_ && client_) (void)client_->Shutdown();
  client_.reset();
  if (children_) {
    for (pid_t pid : children_->Stop()) StopProcess(pid, 2000);
  }
  if (!latest_root_.empty()) UnlinkLatestSession(latest_root_, session_dir_, previous_latest_);
}

std::vector<pid_t> Cluster::local_processes() const {
  return children_ ? children_->Children() : std::vector<pid_t>{};
}

Result<ObjectRef> Cluster::Put(const Tensor& value) { return client_->Put(value); }

Result<std::vector<ObjectRef>> Cluster::Submit(const std::string& op,
                                               const std::vector<ObjectRef>& inputs,
                                               const Attrs& attrs, const SubmitOptions& options) {
  return client_->Submit(op, inputs, attrs, options);
}

Result<Tensor> Cluster::Get(const ObjectRef& ref, int timeout_ms) {
  return client_->Get(ref, timeout_ms);
}

Status Cluster::Wait(const std::vector<ObjectRef>& refs, int timeout_ms) {
  return client_->Wait(refs, timeout_ms);
}

Result<ClusterInfo> Cluster::Info() { return client_->Info(5000); }

Result<std::vector<WorkerWait>> Cluster::Waits() {
  TESSERA_ASSIGN_OR_RETURN(ClusterInfo info, Info());
  std::vector<WorkerWait> waits;
  waits.reserve(info.workers.size());
  for (WorkerInfo& worker : info.workers) {
    waits.push_back(WorkerWait{worker.id, worker.hostname, worker.pid, worker.alive,
                               std::move(worker.waits), std::move(worker.blocked_on)});
  }
  return waits;
}

std::string FormatWait(const WorkerWait& wait) {
  return fmt::format("{} ({}:{}): {}", wait.worker.ToString(), wait.hostname, wait.pid,
                     wait.text.empty() ? "no report" : wait.text);
}

Result<tessera::Timeline> Cluster::Timeline(int last_instances, uint64_t graph) {
  return client_->GetTimeline(last_instances, graph, 30'000);
}

bool Cluster::connected() const { return client_ && client_->connected(); }

Result<GraphHandle> Cluster::RegisterGraph(const Graph& graph) {
  return client_->RegisterGraph(graph);
}

Result<std::map<ObjectId, ObjectRef>> Cluster::RunGraph(
    const GraphHandle& graph, const std::map<ObjectId, ObjectRef>& inputs) {
  return client_->RunGraph(graph, inputs, nullptr);
}

Result<std::map<ObjectId, ObjectRef>> Cluster::RunGraphHandingOver(
    const GraphHandle& graph, const std::map<ObjectId, ObjectRef>& inputs,
    std::vector<ObjectId>* handed_over) {
  std::vector<ObjectId> ids;
  TESSERA_ASSIGN_OR_RETURN(auto outputs, client_->RunGraph(graph, inputs, &ids));
  if (handed_over != nullptr) *handed_over = std::move(ids);
  return outputs;
}

Status Cluster::Shutdown() { return client_->Shutdown(); }
Status Cluster::ReportProgress(const JobProgress& progress) {
  return client_->ReportProgress(progress);
}

}  // namespace tessera
