#include "worker/worker_service.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>

#include "core/collective_task.h"
#include "core/cpu_set.h"
#include "core/cpu_use.h"
#include "core/logging.h"
#include "core/rpc/connection.h"
#include "core/rpc/io_loop.h"
#include "core/rpc/join.h"
#include "core/rpc/wire.h"
#include "core/rpc/wire_limits.h"
#include "core/thread_annotations.h"
#include "core/transport/data_plane.h"
#include "ops/plugin.h"
#include "worker/collective_engine.h"
#include "worker/graph_runner.h"
#include "worker/object_store.h"
#include "worker/swap_file.h"
#include "worker/task_runner.h"

namespace tessera {

namespace {

using rpc::asio::io_context;

// The worker's host allocator, under its --host-cap-gib when it has one.
std::shared_ptr<Allocator> CappedHostAllocator(int64_t cap_bytes) {
  auto allocator = std::make_shared<CachingHostAllocator>();
  if (cap_bytes > 0) {
    allocator->SetCap(cap_bytes, fmt::format("this worker's --host-cap-gib {:.6g}",
                                             static_cast<double>(cap_bytes) / (1 << 30)));
  }
  return allocator;
}

class WorkerServiceImpl final : public WorkerService {
 public:
  WorkerServiceImpl(WorkerServiceOptions options, const OpRegistry& registry)
      : options_(std::move(options)),
        registry_(registry),
        threads_(options_.threads > 0
                     ? options_.threads
                     : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))),
        allocator_(CappedHostAllocator(options_.host_cap_bytes)),
        store_(ObjectStoreOptions{options_.host_capacity_bytes, options_.spill_dir}, allocator_),
        work_(rpc::asio::make_work_guard(io_)) {}

  ~WorkerServiceImpl() override;

  Status Init();
  Status Wait() override EXCLUDES(done_mutex_);
  uint64_t id() const override { return id_; }
  const std::string& data_address() const override { return data_plane_->address(); }

 private:
  Status OnMessage(rpc::ReceivedMessage& message);
  // A plugin's library from the scheduler: loaded (options_.load_plugin), the outcome kept for
  // the parts that name it.
  void OnLoadPlugin(proto::Plugin::Reader plugin);
  // OK when every plugin a part names is loaded here; else why not (the part then fails its
  // instances with it).
  Status PluginsLoaded(capnp::List<proto::Plugin>::Reader plugins) const;
  KernelContext KernelContextHere() const {
    return KernelContext{allocator_, options_.settings.gemm_split_min_flops, &registry_,
                         options_.device.get()};
  }
  void ScheduleHeartbeat();
  void Stop(const Status& reason) EXCLUDES(done_mutex_);
  bool Stopped() EXCLUDES(done_mutex_) {
    MutexLock lock(&done_mutex_);
    return done_;
  }

  const WorkerServiceOptions options_;
  const rpc::WireLimits limits_ = rpc::WireLimits::FromSettings(options_.settings);
  const OpRegistry& registry_;
  std::map<std::string, Status> plugin_loads_;  // by sha256 (io thread)
  const int threads_;
  std::shared_ptr<Allocator> allocator_;
  ObjectStore store_;
  io_context io_;
  rpc::asio::executor_work_guard<io_context::executor_type> work_;
  std::thread io_thread_;
  std::unique_ptr<rpc::asio::steady_timer> heartbeat_timer_;
  CpuMeter cpu_meter_;             // sampled with each heartbeat (io thread)
  bool gpu_meter_failed_ = false;  // a GPU sample failed and was logged (io thread)
  // When the scheduler last sent anything (io thread writes, heartbeat timer reads).
  std::atomic<std::chrono::steady_clock::time_point> last_heard_{std::chrono::steady_clock::now()};
  std::shared_ptr<rpc::Connection> connection_;
  std::unique_ptr<CollectiveEngine> engine_;   // before the graph runner, which uses it
  std::unique_ptr<GraphRunner> graph_runner_;  // before the data plane: its handlers use it
  std::unique_ptr<DataPlane> data_plane_;
  std::atomic<uint64_t> id_{0};
  uint32_t heartbeat_ms_ = 500;

  Mutex done_mutex_;
  CondVar done_cv_;
  bool done_ GUARDED_BY(done_mutex_) = false;
  Status exit_reason_ GUARDED_BY(done_mutex_);
};

WorkerServiceImpl::~WorkerServiceImpl() {
  Stop(Cancelled("worker stopping"));
  work_.reset();
  if (connection_) connection_->Close(Cancelled("worker stopping"));
  if (io_thread_.joinable()) {
    io_.stop();
    io_thread_.join();
  }
  // A collective in progress fails now rather than wait out its timeout on peers that stop too.
  if (engine_) engine_->Stop();
  graph_runner_.reset();
  engine_.reset();
  data_plane_.reset();
}

Status WorkerServiceImpl::Init() {
  TESSERA_RETURN_IF_ERROR(rpc::WireLimits::FromSettings(options_.settings).Check());
  ExecutorOptions executor_options = ExecutorOptions::FromSettings(options_.settings);
  executor_options.threads = threads_;
  executor_options.device = options_.device;
  executor_options.host_allocator = allocator_;  // the store's: one count, one cap
  if (!options_.settings.swap_dir.empty()) {
    SwapFileOptions swap;
    swap.directory = options_.settings.swap_dir;
    Result<std::shared_ptr<DeviceRuntime>> disk = OpenSwapFile(swap);
    if (!disk.ok()) return disk.status().WithContext("TESSERA_SWAP_DIR");
    executor_options.disk = *std::move(disk);
  }
  auto send = [this](capnp::MessageBuilder& message) { connection_->Send(message); };
  engine_ = std::make_unique<CollectiveEngine>(options_.settings, send, KernelContextHere());
  graph_runner_ =
      std::make_unique<GraphRunner>(registry_, executor_options, store_, options_.settings, send);
  graph_runner_->set_collective_engine(engine_.get());
  // The data plane comes next: its address goes into Hello.
  DataPlaneOptions data_options;
  data_options.token = options_.token;
  data_options.host = options_.data_host;
  data_options.chunk_bytes = options_.settings.data_chunk_bytes;
  data_options.pull_timeout_ms = static_cast<int>(options_.settings.pull_timeout_ms);
  data_options.preauth = PendingLimits::FromSettings(options_.settings);
  TESSERA_ASSIGN_OR_RETURN(
      data_plane_,
      DataPlane::Start(
          data_options,
          [this](ObjectId id) -> Result<ServedObject> {
            TESSERA_ASSIGN_OR_RETURN(PinnedObject pinned, store_.Get(id));
            if (!pinned.tensor().meta().device.is_cpu()) {  // served from a host copy
              TESSERA_ASSIGN_OR_RETURN(Tensor host,
                                       HostCopyOf(pinned.tensor(), KernelContextHere()));
              auto holder = std::make_shared<Tensor>(std::move(host));
              return ServedObject{holder->raw_data(), holder->bytes(), holder};
            }
            auto holder = std::make_shared<PinnedObject>(std::move(pinned));
            return ServedObject{holder->tensor().raw_data(), holder->tensor().bytes(), holder};
          },
          PushHandlers{[this](const PushKey& key, int64_t bytes) {
                         return graph_runner_->AcceptPush(key, bytes);
                       },
                       [this](const PushKey& key, const Status& status) {
                         graph_runner_->PushDelivered(key, status);
                       }}));
  graph_runner_->set_data_plane(data_plane_.get());

  io_thread_ = std::thread(
      [this] { rpc::RunIoLoop(io_, std::chrono::microseconds(options_.settings.idle_spin_us)); });
  rpc::HelloFields hello;
  hello.role = proto::Role::WORKER;
  hello.token = options_.token;
  hello.data_address = data_plane_->address();
  hello.cpu_threads = threads_;
  if (options_.device != nullptr) hello.gpu = options_.device->Describe();
  if (Result<std::vector<int>> cpus = ProcessCpus(); cpus.ok()) hello.cpus = FormatCpuList(*cpus);
  hello.host_capacity = options_.host_capacity_bytes;
  TESSERA_ASSIGN_OR_RETURN(
      rpc::Joined joined,
      rpc::Join(
          io_, options_.scheduler, hello, options_.connect_timeout_ms,
          [this](rpc::Connection&, rpc::ReceivedMessage& message) { return OnMessage(message); },
          [this](const Status& reason) { Stop(reason.WithContext("lost the scheduler")); },
          [this](const rpc::Joined& welcome) {
            // The scheduler may send parts and runs right behind the Welcome.
            connection_ = welcome.connection;
            id_ = welcome.id;
            last_heard_ = std::chrono::steady_clock::now();
          }));
  heartbeat_ms_ = joined.heartbeat_interval_ms;
  heartbeat_timer_ = std::make_unique<rpc::asio::steady_timer>(io_);
  rpc::asio::post(io_, [this] { ScheduleHeartbeat(); });
  GetLogger("worker")->info("worker{} joined {}: {} threads, {} MiB host tier, data plane {}",
                            id_.load(), options_.scheduler.ToString(), threads_,
                            options_.host_capacity_bytes >> 20, data_plane_->address());
  return Status::Ok();
}

Status WorkerServiceImpl::OnMessage(rpc::ReceivedMessage& message) {
  last_heard_ = std::chrono::steady_clock::now();
  const auto envelope = message.reader().getRoot<proto::Envelope>();
  // The validated decoding layer (core/rpc/wire_limits.h): a message over a limit is a protocol
  // violation and closes the connection (the worker then joins the scheduler again).
  TESSERA_RETURN_IF_ERROR(rpc::CheckEnvelope(envelope, limits_)
                              .WithContext("a message from the scheduler was refused"));
  auto body = envelope.getBody();
  switch (body.which()) {
    case proto::Envelope::Body::FREE_OBJECTS:
      for (uint64_t id : body.getFreeObjects().getIds()) {
        (void)store_.Delete(ObjectId(id));  // NotFound is fine: it may never have sealed here
      }
      break;
    case proto::Envelope::Body::LOAD_PLUGIN:
      OnLoadPlugin(body.getLoadPlugin());
      break;
    case proto::Envelope::Body::GRAPH_PART: {
      const proto::GraphPart::Reader part = body.getGraphPart();
      graph_runner_->AddPart(id_, part, PluginsLoaded(part.getPlugins()));
      break;
    }
    case proto::Envelope::Body::FORGET_GRAPHS:
      for (uint64_t graph : body.getForgetGraphs().getGraphIds()) graph_runner_->RemovePart(graph);
      break;
    case proto::Envelope::Body::RUN_GRAPH:
      graph_runner_->Start(body.getRunGraph());
      break;
    case proto::Envelope::Body::CANCEL_INSTANCE: {
      auto cancel = body.getCancelInstance();
      graph_runner_->Cancel(cancel.getGraphId(), cancel.getInstance(),
                            cancel.hasError() ? rpc::FromWire(cancel.getError())
                                              : Cancelled("the scheduler cancelled the instance"));
      break;
    }
    case proto::Envelope::Body::COLLECTIVE_PEERS:
      engine_->OnPeers(body.getCollectivePeers());
      break;
    case proto::Envelope::Body::COLLECTIVE_ABORT: {
      auto abort = body.getCollectiveAbort();
      engine_->OnAbort(abort.getGroup(), abort.getEpoch(), rpc::FromWire(abort.getError()));
      break;
    }
    case proto::Envelope::Body::SHUTDOWN:
      Stop(Status::Ok());
      break;
    case proto::Envelope::Body::KEEPALIVE:
      break;  // last_heard_ is enough
    default:
      GetLogger("worker")->warn("ignoring message kind {} from the scheduler",
                                static_cast<int>(body.which()));
      break;
  }
  return Status::Ok();
}

namespace {

// At most this many running tasks and awaited objects travel per heartbeat: enough to explain a
// stuck step, and a heartbeat stays small.
constexpr size_t kMaxWaitItems = 16;

void FillWaitState(const std::vector<GraphRunActivity>& runs, const CollectiveInProgress& member,
                   proto::WaitState::Builder out) {
  // Every instance in progress, each item prefixed with its instance; `instance` names the
  // oldest.
  std::vector<std::string> running;
  std::vector<std::pair<std::string, uint64_t>> awaited;
  for (const GraphRunActivity& run : runs) {
    const std::string prefix = fmt::format("{}.{}/", run.graph, run.instance);
    for (const std::string& task : run.running) running.push_back(prefix + task);
    for (const auto& object : run.awaited) {
      awaited.emplace_back(prefix + object.name, object.producer);
    }
  }
  if (!runs.empty()) {
    out.setInstance(fmt::format("{}.{}", runs.front().graph, runs.front().instance));
  }
  auto names = out.initRunning(static_cast<unsigned>(std::min(running.size(), kMaxWaitItems)));
  for (unsigned i = 0; i < names.size(); ++i) names.set(i, running[i]);
  auto objects = out.initAwaited(static_cast<unsigned>(std::min(awaited.size(), kMaxWaitItems)));
  for (unsigned i = 0; i < objects.size(); ++i) {
    objects[i].setName(awaited[i].first);
    objects[i].setProducer(awaited[i].second);
  }
  if (!member.task.empty()) {
    auto collective = out.initCollective();
    collective.setTask(member.task);
    collective.setOp(member.op);
    collective.setCollective(member.collective);
    collective.setGroup(member.group);
    collective.setRank(member.rank);
    collective.setSize(member.size);
    collective.setForming(member.forming);
    collective.setSinceMicros(std::chrono::duration_cast<std::chrono::microseconds>(
                                  std::chrono::steady_clock::now() - member.since)
                                  .count());
  }
}

}  // namespace

void WorkerServiceImpl::ScheduleHeartbeat() {
  if (Stopped()) return;
  // The scheduler sends a keepalive every heartbeat interval: silence means it is stopped, or
  // its host is gone without closing the connection.
  const auto silent = std::chrono::steady_clock::now() - last_heard_.load();
  if (silent > rpc::SchedulerSilenceLimit(options_.settings.heartbeat_timeout_ms, heartbeat_ms_)) {
    Stop(Unavailable("lost the scheduler: no word from it for {} ms",
                     std::chrono::duration_cast<std::chrono::milliseconds>(silent).count()));
    return;
  }
  const ObjectStoreStats stats = store_.stats();
  rpc::ScopedMessageBuilder message;
  auto heartbeat = message.initRoot<proto::Envelope>().initBody().initHeartbeat();
  heartbeat.setHostUsed(stats.host_bytes);
  heartbeat.setHostCapacity(stats.host_capacity_bytes);
  heartbeat.setSpilledBytes(stats.spilled_bytes);
  heartbeat.setSpilledTotal(stats.spilled_total_bytes);
  heartbeat.setObjects(stats.objects);
  heartbeat.setDeviceBytes(stats.device_bytes);
  heartbeat.setRestores(stats.restores);
  const CpuUse cpu = cpu_meter_.Sample();
  heartbeat.setCpuSeconds(cpu.seconds);
  heartbeat.setCpuUtilization(static_cast<float>(cpu.cores_busy));
  if (options_.gpu_meter != nullptr) {
    Result<GpuUse> gpu = options_.gpu_meter->Sample();
    if (gpu.ok()) {
      auto out = heartbeat.initGpu();
      out.setUtilization(static_cast<float>(gpu->utilization));
      out.setMemoryUsed(gpu->memory_used);
      out.setMemoryTotal(gpu->memory_total);
    } else if (!gpu_meter_failed_) {
      gpu_meter_failed_ = true;
      GetLogger("worker")->warn(
          "a GPU sample failed; heartbeats leave out GPU figures while it does (logged once): {}",
          gpu.status().ToString());
    }
  }
  const GraphRunnerStats runs = graph_runner_->stats();
  heartbeat.setTasksRunning(static_cast<int32_t>(runs.running));
  heartbeat.setTasksDone(runs.tasks_done);
  const DataPlaneStats transfers = data_plane_->stats();
  heartbeat.setBytesPulled(transfers.bytes_pulled);
  heartbeat.setPullMicros(transfers.pull_micros);
  heartbeat.setBytesServed(transfers.bytes_served);
  FillWaitState(graph_runner_->Activity(), engine_->InProgress(), heartbeat.initWaits());
  connection_->Send(message);
  heartbeat_timer_->expires_after(std::chrono::milliseconds(heartbeat_ms_));
  heartbeat_timer_->async_wait([this](const boost::system::error_code& error) {
    if (!error) ScheduleHeartbeat();
  });
}

void WorkerServiceImpl::Stop(const Status& reason) {
  {
    MutexLock lock(&done_mutex_);
    if (done_) return;
    done_ = true;
    exit_reason_ = reason;
  }
  done_cv_.NotifyAll();
}

void WorkerServiceImpl::OnLoadPlugin(proto::Plugin::Reader plugin) {
  const std::string name(plugin.getName().cStr());
  const std::string sha256(plugin.getSha256().cStr());
  const auto library = plugin.getLibrary();
  Status loaded = Unavailable(
      "this worker loads no plugins (a worker process started by `tessera worker` or `tessera "
      "start` does; an in-process one does not)");
  if (options_.load_plugin) {
    loaded = options_.load_plugin(
        name, sha256, std::string(reinterpret_cast<const char*>(library.begin()), library.size()));
  }
  if (loaded.ok()) {
    GetLogger("worker")->info("loaded plugin '{}' (sha256 {})", name, sha256.substr(0, 12));
  } else {
    GetLogger("worker")->warn("plugin '{}' (sha256 {}): {}", name, sha256.substr(0, 12),
                              loaded.ToString());
  }
  plugin_loads_[sha256] = std::move(loaded);
}

Status WorkerServiceImpl::PluginsLoaded(capnp::List<proto::Plugin>::Reader plugins) const {
  for (proto::Plugin::Reader plugin : plugins) {
    const std::string sha256(plugin.getSha256().cStr());
    auto load = plugin_loads_.find(sha256);
    if (load == plugin_loads_.end()) {
      return NotFound("plugin '{}' (sha256 {}) was never sent to this worker",
                      plugin.getName().cStr(), sha256.substr(0, 12));
    }
    if (!load->second.ok()) {
      return load->second.WithContext(
          fmt::format("plugin '{}' on worker{}", plugin.getName().cStr(), id_.load()));
    }
  }
  return Status::Ok();
}

Status WorkerServiceImpl::Wait() {
  MutexLock lock(&done_mutex_);
  while (!done_) done_cv_.Wait(&done_mutex_);
  return exit_reason_;
}

}  // namespace

std::function<Status(std::string_view, std::string_view, std::string)> PluginLoader(
    OpRegistry& registry, std::vector<DeviceKind> devices, std::string dir) {
  // The plugins added to `registry`, by sha256: shared by the copies of the function.
  auto added = std::make_shared<std::set<std::string>>();
  auto mutex = std::make_shared<Mutex>();
  return [&registry, devices = std::move(devices), dir = std::move(dir), added, mutex](
             std::string_view name, std::string_view sha256, std::string library) -> Status {
    MutexLock lock(mutex.get());
    if (added->contains(std::string(sha256))) return Status::Ok();
    TESSERA_ASSIGN_OR_RETURN(const LoadedPlugin* plugin,
                             LoadPluginBytes(name, sha256, std::move(library), dir));
    TESSERA_RETURN_IF_ERROR(AddPluginTo(*plugin, registry, devices));
    added->insert(plugin->sha256);
    return Status::Ok();
  };
}

Result<std::unique_ptr<WorkerService>> WorkerService::Start(const WorkerServiceOptions& options,
                                                            const OpRegistry& registry) {
  auto service = std::make_unique<WorkerServiceImpl>(options, registry);
  TESSERA_RETURN_IF_ERROR(service->Init());
  return std::unique_ptr<WorkerService>(std::move(service));
}

}  // namespace tessera
