#include "client/cluster.h"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "core/atomic_file.h"
#include "core/logging.h"
#include "core/rpc/connection.h"
#include "core/rpc/join.h"
#include "core/rpc/wire.h"
#include "core/settings.h"
#include "core/thread_annotations.h"
#include "core/transport/data_plane.h"
#include "launcher/process.h"
#include "launcher/session.h"
#include "ops/standard_ops.h"
#include "worker/gpu.h"
#include "worker/task_runner.h"

namespace tessera {

struct ObjectRef::State {
  ObjectId id;
  TensorMeta meta;
  std::weak_ptr<detail::ClusterClient> owner;
  ~State();
};

ObjectId ObjectRef::id() const { return state_->id; }
const TensorMeta& ObjectRef::meta() const { return state_->meta; }

namespace detail {

namespace {
constexpr int kIdSequenceBits = 40;  // ids are (driver id << 40) | sequence
constexpr auto kCoalesceWindow = std::chrono::microseconds(100);
}  // namespace

// Everything behind a Cluster: the control connection, the data plane, the objects this driver
// holds, and the batches of outgoing requests.
class ClusterClient : public std::enable_shared_from_this<ClusterClient> {
 public:
  ClusterClient() : work_(rpc::asio::make_work_guard(io_)) {}
  ~ClusterClient();

  Status Connect(const std::string& address, const std::string& token,
                 const ConnectOptions& options);
  Result<ObjectRef> Put(const Tensor& value);
  Result<std::vector<ObjectRef>> Submit(const std::string& op, const std::vector<ObjectRef>& inputs,
                                        const Attrs& attrs, const SubmitOptions& options);
  Result<Tensor> Get(const ObjectRef& ref, int timeout_ms);
  Status Wait(const std::vector<ObjectRef>& refs, int timeout_ms);
  Result<ClusterInfo> Info(int timeout_ms);
  Result<Timeline> GetTimeline(int last_instances, uint64_t graph, int timeout_ms);
  Result<GraphHandle> RegisterGraph(const Graph& graph);
  Result<std::map<ObjectId, ObjectRef>> RunGraph(const GraphHandle& graph,
                                                 const std::map<ObjectId, ObjectRef>& inputs);
  Status Shutdown();
  Status ReportProgress(const JobProgress& progress);
  void Release(ObjectId id);
  bool connected() const { return !closed_; }

 private:
  struct ReadyState {
    Status error;
    std::string inline_data;
    std::string address;
  };

  ObjectRef MakeRef(ObjectId id, const TensorMeta& meta);
  uint64_t NextId() { return (driver_id_ << kIdSequenceBits) | next_sequence_++; }
  Status OnMessage(rpc::ReceivedMessage& message);
  // Sends the queued batches. Urgent (a caller is blocked on the answer): at once. Otherwise a
  // burst coalesces: within kCoalesceWindow of the previous flush, the next one waits for the
  // window's end, so thousands of Submits become a few messages while a lone call is not delayed.
  void ScheduleFlush(bool urgent);  // any thread
  void Flush();                     // io thread
  // Every scheduler interval: closes the connection when the scheduler has been silent past
  // rpc::SchedulerSilenceLimit (stopped, or its host gone), so no call waits on it forever.
  void WatchScheduler();  // io thread
  // Asks the scheduler (once per object) to say when these objects are ready.
  void Watch(const std::vector<ObjectId>& ids);
  // Waits until `id` is ready or failed; returns its state.
  Result<ReadyState> AwaitReady(ObjectId id, int timeout_ms);
  // Waits until `id` is ready or the connection closed: false when `deadline` (if any) passed
  // first.
  bool WaitReady(uint64_t id, std::optional<std::chrono::steady_clock::time_point> deadline)
      REQUIRES(ready_mutex_);

  rpc::asio::io_context io_;
  rpc::asio::executor_work_guard<rpc::asio::io_context::executor_type> work_;
  std::thread io_thread_;
  std::shared_ptr<rpc::Connection> connection_;
  std::unique_ptr<DataPlane> data_plane_;
  OpRegistry registry_;
  Settings settings_;
  std::shared_ptr<Allocator> allocator_ = std::make_shared<AlignedHostAllocator>();
  uint64_t driver_id_ = 0;
  std::atomic<uint64_t> next_sequence_{1};
  std::atomic<bool> closed_{false};
  // Written once, under ready_mutex_, as closed_ is set; read without it once closed_ is seen.
  Status close_reason_;

  Mutex held_mutex_;
  // This driver's Puts, served to workers.
  std::unordered_map<uint64_t, Tensor> held_ GUARDED_BY(held_mutex_);

  // The outgoing batches below. Taken after ready_mutex_ where both are held (Watch).
  Mutex batch_mutex_ ACQUIRED_AFTER(ready_mutex_);
  std::vector<std::pair<ObjectSpec, std::string>> puts_ GUARDED_BY(batch_mutex_);
  std::vector<std::pair<TaskSpec, std::vector<ObjectSpec>>> submits_ GUARDED_BY(batch_mutex_);
  std::vector<uint64_t> watches_ GUARDED_BY(batch_mutex_);
  std::vector<uint64_t> releases_ GUARDED_BY(batch_mutex_);
  bool flush_posted_ GUARDED_BY(batch_mutex_) = false;
  bool flush_timer_armed_ GUARDED_BY(batch_mutex_) = false;
  std::chrono::steady_clock::time_point last_flush_ GUARDED_BY(batch_mutex_);
  std::unique_ptr<rpc::asio::steady_timer> flush_timer_;
  std::unique_ptr<rpc::asio::steady_timer> watchdog_timer_;
  uint32_t scheduler_interval_ms_ = 0;  // from Welcome
  // When the scheduler last sent anything (io thread).
  std::chrono::steady_clock::time_point last_heard_;

  Mutex ready_mutex_;
  CondVar ready_cv_;
  std::unordered_map<uint64_t, ReadyState> ready_ GUARDED_BY(ready_mutex_);
  std::unordered_set<uint64_t> watched_ GUARDED_BY(ready_mutex_);
  std::unordered_map<uint64_t, std::shared_ptr<std::promise<Result<ClusterInfo>>>> status_waiters_
      GUARDED_BY(ready_mutex_);
  std::unordered_map<uint64_t, std::shared_ptr<std::promise<Status>>> reply_waiters_
      GUARDED_BY(ready_mutex_);
  std::unordered_map<uint64_t, std::shared_ptr<std::promise<Result<Timeline>>>> timeline_waiters_
      GUARDED_BY(ready_mutex_);
  uint64_t next_request_ GUARDED_BY(ready_mutex_) = 1;
};

ClusterClient::~ClusterClient() {
  closed_ = true;
  if (connection_) connection_->Close(Cancelled("driver exiting"));
  work_.reset();
  if (io_thread_.joinable()) {
    rpc::asio::post(io_, [this] { io_.stop(); });
    io_thread_.join();
  }
  data_plane_.reset();
}

Status ClusterClient::Connect(const std::string& address, const std::string& token,
                              const ConnectOptions& options) {
  TESSERA_ASSIGN_OR_RETURN(settings_, Settings::FromProcessEnvironment());
  TESSERA_RETURN_IF_ERROR(RegisterStandardOps(registry_));
  TESSERA_ASSIGN_OR_RETURN(rpc::Address parsed, rpc::Address::Parse(address));
  if (!options.admin) {
    DataPlaneOptions data_options;
    data_options.token = token;
    data_options.host = options.data_host;
    if (data_options.host.empty()) data_options.host = settings_.data_host;
    if (data_options.host.empty()) {
      TESSERA_ASSIGN_OR_RETURN(data_options.host, rpc::LocalHostToward(parsed));
    }
    data_options.chunk_bytes = settings_.data_chunk_bytes;
    data_options.pull_timeout_ms = static_cast<int>(settings_.pull_timeout_ms);
    TESSERA_ASSIGN_OR_RETURN(
        data_plane_, DataPlane::Start(data_options, [this](ObjectId id) -> Result<ServedObject> {
          MutexLock lock(&held_mutex_);
          auto it = held_.find(id.value());
          if (it == held_.end()) return NotFound("the driver no longer holds {}", id.ToString());
          return ServedObject{it->second.raw_data(), it->second.bytes(), it->second.buffer()};
        }));
  }
  flush_timer_ = std::make_unique<rpc::asio::steady_timer>(io_);
  watchdog_timer_ = std::make_unique<rpc::asio::steady_timer>(io_);
  io_thread_ = std::thread([this] { io_.run(); });
  rpc::HelloFields hello;
  hello.role = options.admin ? proto::Role::ADMIN : proto::Role::DRIVER;
  hello.token = token;
  if (data_plane_) hello.data_address = data_plane_->address();
  TESSERA_ASSIGN_OR_RETURN(
      rpc::Joined joined,
      rpc::Join(
          io_, parsed, hello, options.timeout_ms,
          [this](rpc::Connection&, rpc::ReceivedMessage& message) { return OnMessage(message); },
          [this](const Status& reason) {
            {
              MutexLock lock(&ready_mutex_);
              close_reason_ = reason.WithContext("lost the connection to the scheduler");
              closed_ = true;
              for (auto& [id, waiter] : status_waiters_) waiter->set_value(close_reason_);
              status_waiters_.clear();
              for (auto& [id, waiter] : reply_waiters_) waiter->set_value(close_reason_);
              reply_waiters_.clear();
              for (auto& [id, waiter] : timeline_waiters_) waiter->set_value(close_reason_);
              timeline_waiters_.clear();
            }
            ready_cv_.NotifyAll();
          },
          [this](const rpc::Joined& welcome) {
            connection_ = welcome.connection;
            driver_id_ = welcome.id;
            scheduler_interval_ms_ = welcome.heartbeat_interval_ms;
            last_heard_ = std::chrono::steady_clock::now();
            WatchScheduler();
          }));
  if (driver_id_ >= (uint64_t{1} << (64 - kIdSequenceBits))) {
    return Internal("driver id {} is too large for object ids", driver_id_);
  }
  return Status::Ok();
}

ObjectRef ClusterClient::MakeRef(ObjectId id, const TensorMeta& meta) {
  auto state = std::make_shared<ObjectRef::State>();
  state->id = id;
  state->meta = meta;
  state->owner = weak_from_this();
  return ObjectRef(std::move(state));
}

Result<ObjectRef> ClusterClient::Put(const Tensor& value) {
  if (!value.defined()) return InvalidArgument("Put of an undefined tensor");
  if (closed_) return close_reason_;
  const ObjectId id(NextId());
  ObjectSpec spec{id, fmt::format("put#{}", id.value() & ((uint64_t{1} << kIdSequenceBits) - 1)),
                  value.meta(), ObjectRole::kInput, TaskId()};
  std::string inline_data;
  if (value.bytes() <= settings_.inline_object_bytes) {
    inline_data.assign(static_cast<const char*>(value.raw_data()),
                       static_cast<size_t>(value.bytes()));
  } else {
    // Objects are immutable: keep a private copy, so the caller may reuse its tensor.
    TESSERA_ASSIGN_OR_RETURN(Tensor copy, value.Clone(allocator_));
    MutexLock lock(&held_mutex_);
    held_[id.value()] = std::move(copy);
  }
  {
    MutexLock lock(&batch_mutex_);
    puts_.emplace_back(std::move(spec), std::move(inline_data));
  }
  ScheduleFlush(/*urgent=*/false);
  return MakeRef(id, value.meta());
}

Result<std::vector<ObjectRef>> ClusterClient::Submit(const std::string& op,
                                                     const std::vector<ObjectRef>& inputs,
                                                     const Attrs& attrs,
                                                     const SubmitOptions& options) {
  if (closed_) return close_reason_;
  std::vector<TensorMeta> input_metas;
  for (const ObjectRef& input : inputs) {
    if (!input.valid()) return InvalidArgument("Submit of '{}' with an empty ObjectRef", op);
    input_metas.push_back(input.meta());
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<TensorMeta> output_metas,
                           registry_.InferShapes(op, input_metas, attrs));
  TESSERA_ASSIGN_OR_RETURN(const OpDef* def, registry_.Find(op));
  TaskSpec task;
  task.id = TaskId(NextId());
  task.name =
      options.name.empty()
          ? fmt::format("{}#{}", op, task.id.value() & ((uint64_t{1} << kIdSequenceBits) - 1))
          : options.name;
  task.op = op;
  task.attrs = attrs;
  task.pinned_worker = options.pinned_worker;
  task.priority = options.priority;
  for (const ObjectRef& input : inputs) task.inputs.push_back(input.id());
  for (const auto& [in, out] : def->in_place) task.donations.push_back(Donation{in, out});
  std::vector<ObjectSpec> outputs;
  std::vector<ObjectRef> refs;
  for (size_t j = 0; j < output_metas.size(); ++j) {
    const ObjectId id(NextId());
    task.outputs.push_back(id);
    task.memory_estimate_bytes += output_metas[j].bytes();
    outputs.push_back(ObjectSpec{id, fmt::format("{}:{}", task.name, def->output_names[j]),
                                 output_metas[j], ObjectRole::kOutput, task.id});
    refs.push_back(MakeRef(id, output_metas[j]));
  }
  {
    MutexLock lock(&batch_mutex_);
    submits_.emplace_back(std::move(task), std::move(outputs));
  }
  ScheduleFlush(/*urgent=*/false);
  return refs;
}

void ClusterClient::Release(ObjectId id) {
  if (closed_) return;
  {
    MutexLock lock(&ready_mutex_);
    ready_.erase(id.value());
    watched_.erase(id.value());
  }
  {
    MutexLock lock(&batch_mutex_);
    releases_.push_back(id.value());
  }
  ScheduleFlush(/*urgent=*/false);
}

void ClusterClient::ScheduleFlush(bool urgent) {
  const auto now = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point at;
  {
    MutexLock lock(&batch_mutex_);
    if (flush_posted_) return;
    if (urgent || now - last_flush_ >= kCoalesceWindow) {
      flush_posted_ = true;
    } else {
      if (flush_timer_armed_) return;
      flush_timer_armed_ = true;
      at = last_flush_ + kCoalesceWindow;
    }
  }
  // `this`, not shared_from_this(): the destructor stops the io thread before members go, and a
  // posted handler must never hold the last reference (the destructor would join itself).
  if (at == std::chrono::steady_clock::time_point()) {
    rpc::asio::post(io_, [this] { Flush(); });
    return;
  }
  rpc::asio::post(io_, [this, at] {
    flush_timer_->expires_at(at);
    flush_timer_->async_wait([this](const boost::system::error_code& error) {
      if (!error) Flush();
    });
  });
}

void ClusterClient::Flush() {
  std::vector<std::pair<ObjectSpec, std::string>> puts;
  std::vector<std::pair<TaskSpec, std::vector<ObjectSpec>>> submits;
  std::vector<uint64_t> watches, releases;
  {
    MutexLock lock(&batch_mutex_);
    flush_posted_ = false;
    flush_timer_armed_ = false;
    last_flush_ = std::chrono::steady_clock::now();
    puts.swap(puts_);
    submits.swap(submits_);
    watches.swap(watches_);
    releases.swap(releases_);
  }
  // Order matters: objects before the tasks that read them, releases last.
  if (!puts.empty()) {
    capnp::MallocMessageBuilder message;
    auto put = message.initRoot<proto::Envelope>().initBody().initPutObjects();
    auto objects = put.initObjects(static_cast<unsigned>(puts.size()));
    auto inlines = put.initInline(static_cast<unsigned>(puts.size()));
    for (unsigned i = 0; i < puts.size(); ++i) {
      rpc::ToWire(puts[i].first, objects[i]);
      const std::string& data = puts[i].second;
      inlines.set(i,
                  capnp::Data::Reader(reinterpret_cast<const kj::byte*>(data.data()), data.size()));
    }
    connection_->Send(message);
  }
  if (!submits.empty()) {
    capnp::MallocMessageBuilder message;
    auto tasks = message.initRoot<proto::Envelope>().initBody().initSubmitTasks().initTasks(
        static_cast<unsigned>(submits.size()));
    for (unsigned i = 0; i < submits.size(); ++i) {
      rpc::ToWire(submits[i].first, submits[i].second, tasks[i]);
    }
    connection_->Send(message);
  }
  if (!watches.empty()) {
    capnp::MallocMessageBuilder message;
    auto ids = message.initRoot<proto::Envelope>().initBody().initWatchObjects().initIds(
        static_cast<unsigned>(watches.size()));
    for (unsigned i = 0; i < watches.size(); ++i) ids.set(i, watches[i]);
    connection_->Send(message);
  }
  if (!releases.empty()) {
    capnp::MallocMessageBuilder message;
    auto ids = message.initRoot<proto::Envelope>().initBody().initReleaseObjects().initIds(
        static_cast<unsigned>(releases.size()));
    for (unsigned i = 0; i < releases.size(); ++i) ids.set(i, releases[i]);
    connection_->Send(message);
  }
}

void ClusterClient::WatchScheduler() {
  if (closed_ || scheduler_interval_ms_ == 0) return;
  const auto silent = std::chrono::steady_clock::now() - last_heard_;
  if (silent > rpc::SchedulerSilenceLimit(settings_.heartbeat_timeout_ms, scheduler_interval_ms_)) {
    connection_->Close(Unavailable(
        "no word from the scheduler for {} ms: it is stopped or its host is unreachable",
        std::chrono::duration_cast<std::chrono::milliseconds>(silent).count()));
    return;
  }
  watchdog_timer_->expires_after(std::chrono::milliseconds(scheduler_interval_ms_));
  watchdog_timer_->async_wait([this](const boost::system::error_code& error) {
    if (!error) WatchScheduler();
  });
}

Status ClusterClient::OnMessage(rpc::ReceivedMessage& message) {
  last_heard_ = std::chrono::steady_clock::now();
  auto envelope = message.reader().getRoot<proto::Envelope>();
  auto body = envelope.getBody();
  switch (body.which()) {
    case proto::Envelope::Body::OBJECTS_READY: {
      {
        MutexLock lock(&ready_mutex_);
        for (auto object : body.getObjectsReady().getObjects()) {
          ReadyState state;
          if (object.hasError()) state.error = rpc::FromWire(object.getError());
          const auto data = object.getInline();
          state.inline_data.assign(reinterpret_cast<const char*>(data.begin()), data.size());
          state.address = rpc::ToString(object.getSource().getAddress());
          if (watched_.contains(object.getId())) ready_[object.getId()] = std::move(state);
        }
      }
      ready_cv_.NotifyAll();
      break;
    }
    case proto::Envelope::Body::FREE_OBJECTS: {
      MutexLock lock(&held_mutex_);
      for (uint64_t id : body.getFreeObjects().getIds()) held_.erase(id);
      break;
    }
    case proto::Envelope::Body::STATUS_REPLY: {
      ClusterInfo info;
      auto status = body.getStatusReply();
      for (auto worker : status.getWorkers()) {
        WorkerInfo w;
        w.id = WorkerId(worker.getId());
        w.hostname = rpc::ToString(worker.getHostname());
        w.pid = worker.getPid();
        w.alive = worker.getAlive();
        w.data_address = rpc::ToString(worker.getDataAddress());
        w.gpu = rpc::ToString(worker.getGpu());
        w.host_used_bytes = worker.getHeartbeat().getHostUsed();
        w.host_capacity_bytes = worker.getHeartbeat().getHostCapacity();
        w.spilled_bytes = worker.getHeartbeat().getSpilledBytes();
        w.tasks_running = worker.getHeartbeat().getTasksRunning();
        w.tasks_done = worker.getHeartbeat().getTasksDone();
        w.bytes_pulled = worker.getHeartbeat().getBytesPulled();
        w.pull_micros = worker.getHeartbeat().getPullMicros();
        w.bytes_served = worker.getHeartbeat().getBytesServed();
        w.waits = rpc::ToString(worker.getWaits());
        for (uint64_t blocked : worker.getBlockedOn()) w.blocked_on.push_back(WorkerId(blocked));
        if (worker.hasLastRun()) {
          auto run = worker.getLastRun();
          w.last_run.graph = run.getGraphId();
          w.last_run.instance = run.getInstance();
          for (int64_t peak : run.getRolePeaks()) w.last_run.role_peaks.push_back(peak);
          w.last_run.model_state_peak = run.getModelStatePeak();
          w.last_run.transient_peak = run.getTransientPeak();
          w.last_run.allocator_peak = run.getAllocatorPeak();
          w.last_run.collective_bytes_sent = run.getCollectiveBytesSent();
          w.last_run.pushed_bytes = run.getPushedBytes();
          w.last_run.wall_ms = static_cast<double>(run.getWallMicros()) / 1000.0;
        }
        info.workers.push_back(std::move(w));
      }
      info.drivers = status.getDrivers();
      info.objects = status.getObjects();
      info.tasks_queued = status.getTasksQueued();
      info.tasks_running = status.getTasksRunning();
      info.tasks_done = status.getTasksDone();
      info.session_dir = rpc::ToString(status.getSessionDir());
      MutexLock lock(&ready_mutex_);
      auto it = status_waiters_.find(envelope.getRequestId());
      if (it != status_waiters_.end()) {
        it->second->set_value(std::move(info));
        status_waiters_.erase(it);
      }
      break;
    }
    case proto::Envelope::Body::TIMELINE_REPLY: {
      Result<Timeline> timeline = rpc::FromWire(body.getTimelineReply());
      MutexLock lock(&ready_mutex_);
      auto it = timeline_waiters_.find(envelope.getRequestId());
      if (it != timeline_waiters_.end()) {
        it->second->set_value(std::move(timeline));
        timeline_waiters_.erase(it);
      }
      break;
    }
    case proto::Envelope::Body::REPLY: {
      Status status =
          body.getReply().getCode() == 0 ? Status::Ok() : rpc::FromWire(body.getReply());
      MutexLock lock(&ready_mutex_);
      auto it = reply_waiters_.find(envelope.getRequestId());
      if (it != reply_waiters_.end()) {
        it->second->set_value(status);
        reply_waiters_.erase(it);
      } else if (!status.ok()) {
        GetLogger("driver")->warn("the scheduler reported: {}", status.ToString());
      }
      break;
    }
    case proto::Envelope::Body::KEEPALIVE:
      break;  // last_heard_ is enough
    default:
      GetLogger("driver")->warn("ignoring message kind {} from the scheduler",
                                static_cast<int>(body.which()));
      break;
  }
  return Status::Ok();
}

void ClusterClient::Watch(const std::vector<ObjectId>& ids) {
  bool added = false;
  {
    MutexLock lock(&ready_mutex_);
    MutexLock batch(&batch_mutex_);
    for (ObjectId id : ids) {
      if (watched_.insert(id.value()).second) {
        watches_.push_back(id.value());
        added = true;
      }
    }
  }
  if (added) ScheduleFlush(/*urgent=*/true);
}

bool ClusterClient::WaitReady(uint64_t id,
                              std::optional<std::chrono::steady_clock::time_point> deadline) {
  while (!closed_ && !ready_.contains(id)) {
    if (!deadline) {
      ready_cv_.Wait(&ready_mutex_);
    } else if (!ready_cv_.WaitUntil(&ready_mutex_, *deadline)) {
      return closed_ || ready_.contains(id);
    }
  }
  return true;
}

Result<ClusterClient::ReadyState> ClusterClient::AwaitReady(ObjectId id, int timeout_ms) {
  Watch({id});
  std::optional<std::chrono::steady_clock::time_point> deadline;
  if (timeout_ms >= 0) {
    deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  }
  MutexLock lock(&ready_mutex_);
  if (!WaitReady(id.value(), deadline)) {
    return TimedOut("{} was not ready within {} ms", id.ToString(), timeout_ms);
  }
  auto it = ready_.find(id.value());
  if (it == ready_.end()) return close_reason_;
  return it->second;
}

Result<Tensor> ClusterClient::Get(const ObjectRef& ref, int timeout_ms) {
  if (!ref.valid()) return InvalidArgument("Get of an empty ObjectRef");
  TESSERA_ASSIGN_OR_RETURN(ReadyState state, AwaitReady(ref.id(), timeout_ms));
  TESSERA_RETURN_IF_ERROR(state.error);
  // On the host whatever device the object lives on (a GPU worker serves a host copy).
  TESSERA_ASSIGN_OR_RETURN(Tensor tensor, Tensor::Empty(OnHost(ref.meta()), allocator_));
  if (!state.inline_data.empty() || tensor.bytes() == 0) {
    if (static_cast<int64_t>(state.inline_data.size()) != tensor.bytes()) {
      return DataLoss("{} came back with {} bytes, {} expected", ref.id().ToString(),
                      state.inline_data.size(), tensor.bytes());
    }
    std::memcpy(tensor.raw_data(), state.inline_data.data(), state.inline_data.size());
    return tensor;
  }
  {
    MutexLock lock(&held_mutex_);
    auto it = held_.find(ref.id().value());
    if (it != held_.end()) return it->second.Clone(allocator_);
  }
  // The holder may die under the pull. The scheduler learns of it within the heartbeat bound
  // (at once when its connection closes) and then says where the object is now (rebuilt from
  // lineage elsewhere) or why it is gone; until it knows, it still names the dead holder.
  const auto verdict_deadline = std::chrono::steady_clock::now() +
                                std::chrono::milliseconds(settings_.heartbeat_timeout_ms + 2000);
  while (true) {
    if (state.address.empty()) {
      return Unavailable("{} has no holder to pull from", ref.id().ToString());
    }
    Status pulled =
        data_plane_->PullAndWait(state.address, ref.id(), tensor.raw_data(), tensor.bytes());
    if (pulled.ok()) return tensor;
    Result<ReadyState> again = Status::Ok();
    do {
      {
        MutexLock lock(&ready_mutex_);
        ready_.erase(ref.id().value());
        watched_.erase(ref.id().value());
      }
      // Waiting as long as the caller allows: a rebuild takes as long as its tasks.
      again = AwaitReady(ref.id(), timeout_ms);
      if (!again.ok()) return pulled;
      if (!again->error.ok()) return again->error;
      if (again->address != state.address || !again->inline_data.empty()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    } while (std::chrono::steady_clock::now() < verdict_deadline);
    if (again->address == state.address && again->inline_data.empty()) return pulled;
    state = std::move(*again);
    if (!state.inline_data.empty()) {
      std::memcpy(tensor.raw_data(), state.inline_data.data(),
                  std::min<size_t>(state.inline_data.size(), static_cast<size_t>(tensor.bytes())));
      return tensor;
    }
  }
}

Status ClusterClient::Wait(const std::vector<ObjectRef>& refs, int timeout_ms) {
  std::vector<ObjectId> ids;
  ids.reserve(refs.size());
  for (const ObjectRef& ref : refs) {
    if (!ref.valid()) return InvalidArgument("Wait on an empty ObjectRef");
    ids.push_back(ref.id());
  }
  Watch(ids);  // one batch of watches; then wait for all of them
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  MutexLock lock(&ready_mutex_);
  for (ObjectId id : ids) {
    if (!WaitReady(id.value(), timeout_ms < 0 ? std::nullopt : std::optional(deadline))) {
      return TimedOut("{} was not ready within {} ms", id.ToString(), timeout_ms);
    }
    auto it = ready_.find(id.value());
    if (it == ready_.end()) return close_reason_;
    if (!it->second.error.ok()) return it->second.error;
  }
  return Status::Ok();
}

Result<ClusterInfo> ClusterClient::Info(int timeout_ms) {
  auto promise = std::make_shared<std::promise<Result<ClusterInfo>>>();
  uint64_t request;
  {
    MutexLock lock(&ready_mutex_);
    if (closed_) return close_reason_;
    request = next_request_++;
    status_waiters_[request] = promise;
  }
  capnp::MallocMessageBuilder message;
  auto envelope = message.initRoot<proto::Envelope>();
  envelope.setRequestId(request);
  envelope.initBody().initStatusRequest();
  connection_->Send(message);
  std::future<Result<ClusterInfo>> future = promise->get_future();
  if (future.wait_for(std::chrono::milliseconds(timeout_ms)) != std::future_status::ready) {
    MutexLock lock(&ready_mutex_);
    status_waiters_.erase(request);
    return TimedOut("the scheduler did not answer a status request within {} ms", timeout_ms);
  }
  return future.get();
}

Result<Timeline> ClusterClient::GetTimeline(int last_instances, uint64_t graph, int timeout_ms) {
  auto promise = std::make_shared<std::promise<Result<Timeline>>>();
  uint64_t request;
  {
    MutexLock lock(&ready_mutex_);
    if (closed_) return close_reason_;
    request = next_request_++;
    timeline_waiters_[request] = promise;
  }
  capnp::MallocMessageBuilder message;
  auto envelope = message.initRoot<proto::Envelope>();
  envelope.setRequestId(request);
  auto wire = envelope.initBody().initTimelineRequest();
  wire.setLastInstances(last_instances);
  wire.setGraphId(graph);
  connection_->Send(message);
  std::future<Result<Timeline>> future = promise->get_future();
  if (future.wait_for(std::chrono::milliseconds(timeout_ms)) != std::future_status::ready) {
    MutexLock lock(&ready_mutex_);
    timeline_waiters_.erase(request);
    return TimedOut("the scheduler did not answer a timeline request within {} ms", timeout_ms);
  }
  return future.get();
}

Result<GraphHandle> ClusterClient::RegisterGraph(const Graph& graph) {
  if (closed_) return close_reason_;
  TESSERA_RETURN_IF_ERROR(graph.Validate());
  for (const TaskSpec& task : graph.tasks()) {
    TESSERA_RETURN_IF_ERROR(
        registry_.Find(task.op).status().WithContext("task '" + task.name + "'"));
  }
  GraphHandle handle;
  handle.id_ = NextId();
  handle.graph_ = std::make_shared<const Graph>(graph);
  auto promise = std::make_shared<std::promise<Status>>();
  uint64_t request;
  {
    MutexLock lock(&ready_mutex_);
    request = next_request_++;
    reply_waiters_[request] = promise;
  }
  capnp::MallocMessageBuilder message;
  auto envelope = message.initRoot<proto::Envelope>();
  envelope.setRequestId(request);
  auto wire = envelope.initBody().initRegisterGraph();
  wire.setGraphId(handle.id_);
  auto objects = wire.initObjects(static_cast<unsigned>(graph.num_objects()));
  for (unsigned i = 0; i < objects.size(); ++i) rpc::ToWire(graph.objects()[i], objects[i]);
  auto tasks = wire.initTasks(static_cast<unsigned>(graph.num_tasks()));
  for (unsigned i = 0; i < tasks.size(); ++i) {
    const TaskSpec& task = graph.tasks()[i];
    std::vector<ObjectSpec> outputs;
    for (ObjectId output : task.outputs) outputs.push_back(graph.object(output));
    rpc::ToWire(task, outputs, tasks[i]);
  }
  auto outputs = wire.initOutputs(static_cast<unsigned>(graph.OutputObjects().size()));
  for (unsigned i = 0; i < outputs.size(); ++i) outputs.set(i, graph.OutputObjects()[i].value());
  connection_->Send(message);
  std::future<Status> future = promise->get_future();
  if (future.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    return TimedOut("the scheduler did not answer the registration of a {}-task graph in 60 s",
                    graph.num_tasks());
  }
  TESSERA_RETURN_IF_ERROR(future.get());
  return handle;
}

Result<std::map<ObjectId, ObjectRef>> ClusterClient::RunGraph(
    const GraphHandle& handle, const std::map<ObjectId, ObjectRef>& inputs) {
  if (closed_) return close_reason_;
  if (!handle.valid()) return InvalidArgument("RunGraph of an unregistered graph");
  const Graph& graph = handle.graph();
  std::vector<ObjectRef> bound;
  for (ObjectId input : graph.InputObjects()) {
    auto it = inputs.find(input);
    const ObjectSpec& spec = graph.object(input);
    if (it == inputs.end() || !it->second.valid()) {
      return InvalidArgument("graph input '{}' ({}) is not bound", spec.name, spec.meta.ToString());
    }
    if (!it->second.meta().BindsTo(spec.meta)) {
      return InvalidArgument("graph input '{}' expects {} but is bound to {}", spec.name,
                             spec.meta.ToString(), it->second.meta().ToString());
    }
    bound.push_back(it->second);
  }
  // The scheduler binds only finished objects: wait for them here (usually already done).
  TESSERA_RETURN_IF_ERROR(Wait(bound, -1));
  std::map<ObjectId, ObjectRef> outputs;
  capnp::MallocMessageBuilder message;
  auto run = message.initRoot<proto::Envelope>().initBody().initRunGraph();
  run.setGraphId(handle.id());
  run.setInstance(NextId());
  const std::vector<ObjectId> input_ids = graph.InputObjects();
  auto bindings = run.initInputs(static_cast<unsigned>(input_ids.size()));
  for (unsigned i = 0; i < input_ids.size(); ++i) {
    bindings[i].setObject(input_ids[i].value());
    bindings[i].initSource().setObject(inputs.at(input_ids[i]).id().value());
  }
  const std::vector<ObjectId>& graph_outputs = graph.OutputObjects();
  auto ids = run.initOutputIds(static_cast<unsigned>(graph_outputs.size()));
  for (unsigned i = 0; i < graph_outputs.size(); ++i) {
    const ObjectId id(NextId());
    ids.set(i, id.value());
    outputs.emplace(graph_outputs[i], MakeRef(id, graph.object(graph_outputs[i]).meta));
  }
  // Queued batches (a Put of an input, a Release) must reach the scheduler first.
  Flush();
  connection_->Send(message);
  return outputs;
}

Status ClusterClient::ReportProgress(const JobProgress& progress) {
  if (closed_) return close_reason_;
  capnp::MallocMessageBuilder message;
  auto body = message.initRoot<proto::Envelope>().initBody().initJobProgress();
  body.setJob(progress.job);
  body.setStep(progress.step);
  body.setLoss(progress.loss);
  body.setStepMs(progress.step_ms);
  body.setTokensPerSecond(progress.tokens_per_second);
  body.setSamplesPerSecond(progress.samples_per_second);
  connection_->Send(message);
  return Status::Ok();
}

Status ClusterClient::Shutdown() {
  if (closed_) return close_reason_;
  capnp::MallocMessageBuilder message;
  message.initRoot<proto::Envelope>().initBody().initShutdown();
  connection_->Send(message);
  return Status::Ok();
}

}  // namespace detail

ObjectRef::State::~State() {
  if (auto owner_client = owner.lock()) owner_client->Release(id);
}

namespace {

Result<std::string> ResolveToken(const ConnectOptions& options) {
  if (!options.token.empty()) return options.token;
  std::string path = options.token_file;
  if (path.empty()) {
    const char* env = std::getenv("TESSERA_TOKEN_FILE");
    path = env != nullptr ? env : std::string(kLatestSession) + "/token";
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

// `count` more workers of a local cluster like the first ones (GPU workers on `gpus`).
WorkerLaunch LocalLaunch(const LocalClusterOptions& options, const std::vector<int>& gpus,
                         const std::string& scheduler, int count, std::string tag) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return WorkerLaunch{
      .scheduler = scheduler,
      .count = count,
      .threads = options.threads_per_worker > 0
                     ? options.threads_per_worker
                     : std::max(1, cores / std::max(1, LocalWorkers(options))),
      .host_memory_mb = options.host_capacity_bytes >> 20,
      .tag = std::move(tag),
      .gpus = gpus,
      .gpu_memory_gib = options.gpu_memory_gib,
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
  TESSERA_ASSIGN_OR_RETURN(
      LocalSession session,
      LocalSession::Create(options.session_dir, "local",
                           SessionProcesses{.binary = binary, .detached = false}));
  std::unique_ptr<Cluster> cluster(new Cluster());  // stops what was started if a step fails
  cluster->session_dir_ = session.dir();
  cluster->local_options_ = options;
  cluster->local_options_.tessera_binary = binary;
  TESSERA_ASSIGN_OR_RETURN(
      StartedScheduler scheduler,
      session.StartScheduler(
          {.host = "127.0.0.1", .port = 0, .timeout_ms = options.start_timeout_ms}));
  cluster->processes_.push_back(scheduler.pid);
  cluster->address_ = scheduler.address;

  // Everything here is on this machine: workers and this driver join over the Unix socket.
  const WorkerLaunch workers = LocalLaunch(options, gpus, scheduler.local_address, count, "");
  TESSERA_ASSIGN_OR_RETURN(std::vector<pid_t> pids, session.StartWorkers(workers));
  cluster->processes_.insert(cluster->processes_.end(), pids.begin(), pids.end());
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
  const WorkerLaunch workers = LocalLaunch(local_options_, local_gpus_, local_address_, count,
                                           fmt::format("added{}", started_workers_));
  started_workers_ += count;
  TESSERA_ASSIGN_OR_RETURN(std::vector<pid_t> pids, session.StartWorkers(workers));
  processes_.insert(processes_.end(), pids.begin(), pids.end());
  return session.AwaitWorkers(
      [&]() -> Result<int> {
        TESSERA_ASSIGN_OR_RETURN(ClusterInfo info, client_->Info(2000));
        return info.alive_workers();
      },
      before.alive_workers() + count, pids, workers, local_options_.start_timeout_ms);
}

Cluster::~Cluster() {
  if (!processes_.empty() && client_) (void)client_->Shutdown();
  client_.reset();
  for (pid_t pid : processes_) StopProcess(pid, 2000);
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
  return client_->RunGraph(graph, inputs);
}

Status Cluster::Shutdown() { return client_->Shutdown(); }
Status Cluster::ReportProgress(const JobProgress& progress) {
  return client_->ReportProgress(progress);
}

}  // namespace tessera
