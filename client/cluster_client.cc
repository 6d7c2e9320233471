// ClusterClient's connection to the scheduler (cluster_client.h): joining, the batches of
// outgoing requests and their flushing, the scheduler's messages, and waiting for objects and
// for replies.
#include "client/cluster_client.h"

#include "core/logging.h"
#include "core/rpc/frame.h"
#include "core/rpc/io_loop.h"
#include "core/rpc/join.h"
#include "core/rpc/wire.h"
#include "core/rpc/wire_limits.h"
#include "ops/standard_ops.h"

namespace tessera::detail {

namespace {

// A worker's line of a status reply.
WorkerInfo WorkerFromWire(proto::WorkerStatus::Reader worker) {
  WorkerInfo w;
  w.id = WorkerId(worker.getId());
  w.hostname = rpc::ToString(worker.getHostname());
  w.pid = worker.getPid();
  w.alive = worker.getAlive();
  w.data_address = rpc::ToString(worker.getDataAddress());
  w.gpu = rpc::ToString(worker.getGpu());
  w.cpus = rpc::ToString(worker.getCpus());
  w.host_used_bytes = worker.getHeartbeat().getHostUsed();
  w.host_capacity_bytes = worker.getHeartbeat().getHostCapacity();
  w.spilled_bytes = worker.getHeartbeat().getSpilledBytes();
  w.spilled_total_bytes = worker.getHeartbeat().getSpilledTotal();
  w.tasks_running = worker.getHeartbeat().getTasksRunning();
  w.tasks_done = worker.getHeartbeat().getTasksDone();
  w.bytes_pulled = worker.getHeartbeat().getBytesPulled();
  w.pull_micros = worker.getHeartbeat().getPullMicros();
  w.bytes_served = worker.getHeartbeat().getBytesServed();
  w.cpu_seconds = worker.getHeartbeat().getCpuSeconds();
  w.cpu_utilization = worker.getHeartbeat().getCpuUtilization();
  if (worker.getHeartbeat().hasGpu()) {
    const auto gpu = worker.getHeartbeat().getGpu();
    w.gpu_use = GpuUse{gpu.getUtilization(), gpu.getMemoryUsed(), gpu.getMemoryTotal()};
  }
  w.objects = worker.getHeartbeat().getObjects();
  w.device_bytes = worker.getHeartbeat().getDeviceBytes();
  w.restores = worker.getHeartbeat().getRestores();
  w.waits = rpc::ToString(worker.getWaits());
  for (uint64_t blocked : worker.getBlockedOn()) w.blocked_on.push_back(WorkerId(blocked));
  if (worker.hasLastRun()) {
    auto run = worker.getLastRun();
    w.last_run.graph = run.getGraphId();
    w.last_run.instance = run.getInstance();
    for (int64_t peak : run.getRolePeaks()) w.last_run.role_peaks.push_back(peak);
    w.last_run.model_state_peak = run.getModelStatePeak();
    w.last_run.transient_peak = run.getTransientPeak();
    w.last_run.total_peak = run.getTotalPeak();
    w.last_run.total_with_scratch_peak = run.getTotalWithScratchPeak();
    w.last_run.allocator_peak = run.getAllocatorPeak();
    w.last_run.collective_bytes_sent = run.getCollectiveBytesSent();
    w.last_run.pushed_bytes = run.getPushedBytes();
    w.last_run.wall_ms = static_cast<double>(run.getWallMicros()) / 1000.0;
  }
  return w;
}

ClusterInfo ClusterInfoFromWire(proto::ClusterStatus::Reader status) {
  ClusterInfo info;
  for (auto worker : status.getWorkers()) info.workers.push_back(WorkerFromWire(worker));
  info.drivers = status.getDrivers();
  info.objects = status.getObjects();
  info.tasks_queued = status.getTasksQueued();
  info.tasks_running = status.getTasksRunning();
  info.tasks_done = status.getTasksDone();
  info.session_dir = rpc::ToString(status.getSessionDir());
  return info;
}

}  // namespace

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
  TESSERA_RETURN_IF_ERROR(RegisterStandardOps(registry_));  // with the plugins loaded by now
  {
    MutexLock lock(&plugins_mutex_);
    for (const LoadedPlugin* plugin : LoadedPlugins()) plugins_in_registry_.insert(plugin->sha256);
  }
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
    data_options.preauth = PendingLimits::FromSettings(settings_);
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
  io_thread_ = std::thread(
      [this] { rpc::RunIoLoop(io_, std::chrono::microseconds(settings_.idle_spin_us)); });
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
              close_reason_ = (refused_.ok() ? reason : refused_)
                                  .WithContext("lost the connection to the scheduler");
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

void ClusterClient::ScheduleFlush(FlushWhen when) {
  const auto now = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point at;
  {
    MutexLock lock(&batch_mutex_);
    const bool quiet = now - last_flush_ >= kCoalesceWindow;
    if (when == FlushWhen::kLazy || (when == FlushWhen::kSoon && !quiet)) {
      if (flush_timer_armed_) return;
      flush_timer_armed_ = true;
      at = quiet ? now + kCoalesceWindow : last_flush_ + kCoalesceWindow;
    }
  }
  if (at == std::chrono::steady_clock::time_point()) {
    Flush();
    return;
  }
  // `this`, not shared_from_this(): the destructor stops the io thread before members go, and a
  // posted handler must never hold the last reference (the destructor would join itself).
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
  MutexLock flushing(&flush_mutex_);
  {
    MutexLock lock(&batch_mutex_);
    flush_timer_armed_ = false;
    last_flush_ = std::chrono::steady_clock::now();
    puts.swap(puts_);
    submits.swap(submits_);
    watches.swap(watches_);
    releases.swap(releases_);
  }
  // Order matters: objects before the tasks that read them, releases last. The frames go out
  // back to back in one write: one wake-up of the scheduler, one read there.
  std::vector<uint8_t> frames;
  if (!puts.empty()) {
    rpc::ScopedMessageBuilder message;
    auto put = message.initRoot<proto::Envelope>().initBody().initPutObjects();
    auto objects = put.initObjects(static_cast<unsigned>(puts.size()));
    auto inlines = put.initInline(static_cast<unsigned>(puts.size()));
    for (unsigned i = 0; i < puts.size(); ++i) {
      rpc::ToWire(puts[i].first, objects[i]);
      const std::string& data = puts[i].second;
      inlines.set(i,
                  capnp::Data::Reader(reinterpret_cast<const kj::byte*>(data.data()), data.size()));
    }
    rpc::AppendFrame(message, frames);
  }
  if (!submits.empty()) {
    rpc::ScopedMessageBuilder message;
    auto tasks = message.initRoot<proto::Envelope>().initBody().initSubmitTasks().initTasks(
        static_cast<unsigned>(submits.size()));
    for (unsigned i = 0; i < submits.size(); ++i) {
      rpc::ToWire(submits[i].first, submits[i].second, tasks[i]);
    }
    rpc::AppendFrame(message, frames);
  }
  if (!watches.empty()) {
    rpc::ScopedMessageBuilder message;
    auto ids = message.initRoot<proto::Envelope>().initBody().initWatchObjects().initIds(
        static_cast<unsigned>(watches.size()));
    for (unsigned i = 0; i < watches.size(); ++i) ids.set(i, watches[i]);
    rpc::AppendFrame(message, frames);
  }
  if (!releases.empty()) {
    rpc::ScopedMessageBuilder message;
    auto ids = message.initRoot<proto::Envelope>().initBody().initReleaseObjects().initIds(
        static_cast<unsigned>(releases.size()));
    for (unsigned i = 0; i < releases.size(); ++i) ids.set(i, releases[i]);
    rpc::AppendFrame(message, frames);
  }
  if (!frames.empty()) connection_->SendFrame(std::move(frames));
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
  // The validated decoding layer (core/rpc/wire_limits.h): over a limit, the connection closes.
  TESSERA_RETURN_IF_ERROR(rpc::CheckEnvelope(envelope, rpc::WireLimits::FromSettings(settings_))
                              .WithContext("a message from the scheduler was refused"));
  auto body = envelope.getBody();
  switch (body.which()) {
    case proto::Envelope::Body::OBJECTS_READY:
      OnObjectsReady(body.getObjectsReady());
      break;
    case proto::Envelope::Body::HANDED_BACK:
      OnHandedBack(body.getHandedBack());
      break;
    case proto::Envelope::Body::FREE_OBJECTS: {
      MutexLock lock(&held_mutex_);
      for (uint64_t id : body.getFreeObjects().getIds()) held_.erase(id);
      break;
    }
    case proto::Envelope::Body::STATUS_REPLY: {
      ClusterInfo info = ClusterInfoFromWire(body.getStatusReply());
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
    case proto::Envelope::Body::REFUSED: {
      // A message of ours broke the protocol (over a wire limit, ...): the scheduler says why
      // and closes the connection.
      const Status refused = rpc::FromWire(body.getRefused());
      GetLogger("driver")->error("the scheduler refused a message: {}", refused.ToString());
      MutexLock lock(&ready_mutex_);
      refused_ = refused;
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

void ClusterClient::OnObjectsReady(proto::ObjectsReady::Reader ready) {
  {
    MutexLock lock(&ready_mutex_);
    for (auto object : ready.getObjects()) {
      ReadyState state;
      if (object.hasError()) state.error = rpc::FromWire(object.getError());
      const auto data = object.getInline();
      state.inline_data.assign(reinterpret_cast<const char*>(data.begin()), data.size());
      state.address = rpc::ToString(object.getSource().getAddress());
      if (watched_.contains(object.getId())) ready_[object.getId()] = std::move(state);
    }
  }
  ready_cv_.NotifyAll();
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
  if (added) ScheduleFlush(FlushWhen::kAwaited);
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

Result<ClusterInfo> ClusterClient::Info(int timeout_ms) {
  auto promise = std::make_shared<std::promise<Result<ClusterInfo>>>();
  uint64_t request;
  {
    MutexLock lock(&ready_mutex_);
    if (closed_) return close_reason_;
    request = next_request_++;
    status_waiters_[request] = promise;
  }
  rpc::ScopedMessageBuilder message;
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
  rpc::ScopedMessageBuilder message;
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

Status ClusterClient::ReportProgress(const JobProgress& progress) {
  if (closed_) return close_reason_;
  rpc::ScopedMessageBuilder message;
  auto body = message.initRoot<proto::Envelope>().initBody().initJobProgress();
  body.setJob(progress.job);
  body.setStep(progress.step);
  body.setLoss(progress.loss);
  body.setStepMs(progress.step_ms);
  body.setTokensPerSecond(progress.tokens_per_second);
  body.setSamplesPerSecond(progress.samples_per_second);
  body.setValidationLoss(progress.validation_loss);
  body.setPlan(progress.plan);
  connection_->Send(message);
  return Status::Ok();
}

Status ClusterClient::Shutdown() {
  if (closed_) return close_reason_;
  rpc::ScopedMessageBuilder message;
  message.initRoot<proto::Envelope>().initBody().initShutdown();
  connection_->Send(message);
  return Status::Ok();
}

}  // namespace tessera::detail
