#include "worker/worker_service.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <future>
#include <optional>
#include <queue>
#include <thread>
#include <unordered_map>

#include <tbb/task_arena.h>

#include "core/collective_task.h"
#include "core/logging.h"
#include "core/rpc/connection.h"
#include "core/rpc/join.h"
#include "core/rpc/wire.h"
#include "core/transport/data_plane.h"
#include "worker/collective_engine.h"
#include "worker/graph_runner.h"
#include "worker/object_store.h"
#include "worker/task_runner.h"

namespace tessera {

namespace {

using rpc::asio::io_context;

constexpr auto kResultCoalesceWindow = std::chrono::microseconds(100);

class WorkerServiceImpl final : public WorkerService {
 public:
  WorkerServiceImpl(WorkerServiceOptions options, const OpRegistry& registry)
      : options_(std::move(options)),
        registry_(registry),
        threads_(options_.threads > 0
                     ? options_.threads
                     : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))),
        allocator_(std::make_shared<CachingHostAllocator>()),
        store_(ObjectStoreOptions{options_.host_capacity_bytes, options_.spill_dir}, allocator_),
        arena_(threads_),
        work_(rpc::asio::make_work_guard(io_)) {}

  ~WorkerServiceImpl() override;

  Status Init();
  Status Wait() override;
  uint64_t id() const override { return id_; }
  const std::string& data_address() const override { return data_plane_->address(); }

 private:
  struct PendingTask {
    rpc::WireTask task;
    const KernelFn* kernel = nullptr;
    std::vector<Tensor> inputs;
    std::vector<PinnedObject> pins;  // local inputs, kept in host memory until the task ends
    int missing = 0;
    Status error;
    uint64_t sequence = 0;
  };
  struct ReadyOrder {
    bool operator()(const PendingTask* a, const PendingTask* b) const {
      if (a->task.spec.priority != b->task.spec.priority) {
        return a->task.spec.priority < b->task.spec.priority;
      }
      return a->sequence > b->sequence;  // FIFO among equals
    }
  };
  struct TaskResult {
    uint64_t task = 0;
    Status error;
    std::vector<std::pair<uint64_t, int64_t>> outputs;  // id, bytes
    std::vector<std::string> inlines;                   // per output; empty when pulled
  };

  Status OnMessage(rpc::ReceivedMessage& message);
  void OnDispatch(proto::DispatchTasks::Reader dispatch);
  void InputArrived(uint64_t task, const Status& status);
  void MakeReady(uint64_t task);
  void StartReadyTasks();
  void Execute(PendingTask* task);
  static bool IsMember(const TaskSpec& spec);
  static std::vector<TensorMeta> OutputMetas(const PendingTask& task);
  KernelContext KernelContextHere() const {
    return KernelContext{allocator_, options_.settings.gemm_split_min_flops, &registry_,
                         options_.device.get()};
  }
  // Hands a ready collective member to the engine; its result comes back like a task's.
  void SubmitMember(PendingTask* task);
  // A member that failed before reaching the engine: lets its position pass.
  void AbandonMember(const TaskSpec& spec);
  TaskResult Seal(const TaskSpec& spec, Result<std::vector<Tensor>> outputs);
  // Reports a task that failed before running (bad dispatch, failed pull).
  void Finish(uint64_t task, const Status& error);
  void Queue(TaskResult result);
  void FlushResults();
  void ScheduleHeartbeat();
  void Stop(const Status& reason);

  const WorkerServiceOptions options_;
  const OpRegistry& registry_;
  const int threads_;
  std::shared_ptr<Allocator> allocator_;
  ObjectStore store_;
  tbb::task_arena arena_;
  io_context io_;
  rpc::asio::executor_work_guard<io_context::executor_type> work_;
  std::thread io_thread_;
  std::unique_ptr<rpc::asio::steady_timer> heartbeat_timer_;
  // When the scheduler last sent anything (io thread writes, heartbeat timer reads).
  std::atomic<std::chrono::steady_clock::time_point> last_heard_{std::chrono::steady_clock::now()};
  std::unique_ptr<rpc::asio::steady_timer> flush_timer_;
  std::shared_ptr<rpc::Connection> connection_;
  std::unique_ptr<CollectiveEngine> engine_;   // before the graph runner, which uses it
  std::unique_ptr<GraphRunner> graph_runner_;  // before the data plane: its handlers use it
  std::unique_ptr<DataPlane> data_plane_;
  std::atomic<uint64_t> id_{0};
  uint32_t heartbeat_ms_ = 500;

  // io-thread state
  std::unordered_map<uint64_t, std::unique_ptr<PendingTask>> tasks_;
  std::priority_queue<PendingTask*, std::vector<PendingTask*>, ReadyOrder> ready_;
  int running_ = 0;
  uint64_t next_sequence_ = 0;
  int64_t tasks_done_ = 0;
  std::vector<TaskResult> results_;
  bool flush_posted_ = false;

  std::mutex done_mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  Status exit_reason_;
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
  arena_.execute([] {});  // arena work finishes before the store goes away
  graph_runner_.reset();
  engine_.reset();
  data_plane_.reset();
}

Status WorkerServiceImpl::Init() {
  ExecutorOptions executor_options = ExecutorOptions::FromSettings(options_.settings);
  executor_options.threads = threads_;
  executor_options.device = options_.device;
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

  flush_timer_ = std::make_unique<rpc::asio::steady_timer>(io_);
  io_thread_ = std::thread([this] { io_.run(); });
  rpc::HelloFields hello;
  hello.role = proto::Role::WORKER;
  hello.token = options_.token;
  hello.data_address = data_plane_->address();
  hello.cpu_threads = threads_;
  if (options_.device != nullptr) hello.gpu = options_.device->Describe();
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
  auto body = message.reader().getRoot<proto::Envelope>().getBody();
  switch (body.which()) {
    case proto::Envelope::Body::DISPATCH_TASKS:
      OnDispatch(body.getDispatchTasks());
      break;
    case proto::Envelope::Body::FREE_OBJECTS:
      for (uint64_t id : body.getFreeObjects().getIds()) {
        (void)store_.Delete(ObjectId(id));  // NotFound is fine: it may never have sealed here
      }
      break;
    case proto::Envelope::Body::GRAPH_PART:
      graph_runner_->AddPart(id_, body.getGraphPart());
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

void WorkerServiceImpl::OnDispatch(proto::DispatchTasks::Reader dispatch) {
  for (proto::DispatchedTask::Reader dispatched : dispatch.getTasks()) {
    const uint64_t id = dispatched.getTask().getId();
    Result<rpc::WireTask> parsed = rpc::FromWire(dispatched.getTask());
    if (!parsed.ok()) {
      Finish(id, parsed.status());
      continue;
    }
    auto owned = std::make_unique<PendingTask>();
    PendingTask& task = *owned;
    task.task = std::move(*parsed);
    task.sequence = next_sequence_++;
    const TaskSpec& spec = task.task.spec;
    Result<const KernelFn*> kernel = registry_.FindKernel(spec.op, DeviceKind::kCpu);
    if (!kernel.ok()) {
      Finish(id, kernel.status().WithContext(TaskContext(spec)));
      continue;
    }
    task.kernel = *kernel;
    const auto metas = dispatched.getInputMetas();
    if (metas.size() != spec.inputs.size()) {
      Finish(id, InvalidArgument("{}: dispatch has {} input metas for {} inputs", TaskContext(spec),
                                 metas.size(), spec.inputs.size()));
      continue;
    }
    std::unordered_map<uint64_t, capnp::Data::Reader> inlines;
    for (auto object : dispatched.getInlineInputs())
      inlines.emplace(object.getId(), object.getInline());
    std::unordered_map<uint64_t, std::string> addresses;
    for (auto source : dispatched.getSources()) {
      addresses.emplace(source.getObject(), rpc::ToString(source.getAddress()));
    }
    task.inputs.resize(spec.inputs.size());
    // Pulls start after the task is registered, so their callbacks always find it.
    std::vector<std::pair<size_t, std::string>> pulls;
    for (size_t i = 0; i < spec.inputs.size() && task.error.ok(); ++i) {
      const ObjectId input = spec.inputs[i];
      Result<TensorMeta> meta = rpc::FromWire(metas[static_cast<unsigned>(i)]);
      if (!meta.ok()) {
        task.error = meta.status();
        break;
      }
      if (auto it = inlines.find(input.value()); it != inlines.end()) {
        if (static_cast<int64_t>(it->second.size()) != meta->bytes()) {
          task.error =
              InvalidArgument("inline input {} has {} bytes, its meta {} needs {}",
                              input.ToString(), it->second.size(), meta->ToString(), meta->bytes());
          break;
        }
        Result<Tensor> tensor = Tensor::Empty(*meta, allocator_);
        if (!tensor.ok()) {
          task.error = tensor.status();
          break;
        }
        std::memcpy(tensor->raw_data(), it->second.begin(), it->second.size());
        task.inputs[i] = *std::move(tensor);
      } else if (store_.Contains(input)) {
        Result<PinnedObject> pinned = store_.Get(input);
        if (!pinned.ok()) {
          task.error = pinned.status();
          break;
        }
        // Dynamic tasks run CPU kernels: an object on this worker's GPU comes as a host copy.
        Result<Tensor> host = HostCopyOf(pinned->tensor(), KernelContextHere());
        if (!host.ok()) {
          task.error = host.status().WithContext(TaskContext(spec));
          break;
        }
        task.inputs[i] = *std::move(host);
        task.pins.push_back(std::move(*pinned));
      } else if (auto source = addresses.find(input.value()); source != addresses.end()) {
        Result<Tensor> tensor = Tensor::Empty(*meta, allocator_);
        if (!tensor.ok()) {
          task.error = tensor.status();
          break;
        }
        task.inputs[i] = *std::move(tensor);
        pulls.emplace_back(i, source->second);
      } else {
        task.error = Internal("{}: input {} is neither here, inline, nor given a source",
                              TaskContext(spec), input.ToString());
      }
    }
    if (!task.error.ok()) {
      const Status error = task.error;
      AbandonMember(spec);
      Finish(id, error);
      continue;
    }
    task.missing = static_cast<int>(pulls.size());
    PendingTask* raw = owned.get();
    tasks_[id] = std::move(owned);
    if (pulls.empty()) {
      MakeReady(id);
      continue;
    }
    for (const auto& [index, address] : pulls) {
      Tensor& dest = raw->inputs[index];
      data_plane_->Pull(address, raw->task.spec.inputs[index], dest.raw_data(), dest.bytes(),
                        [this, id](const Status& status) {
                          rpc::asio::post(io_, [this, id, status] { InputArrived(id, status); });
                        });
    }
  }
  StartReadyTasks();
}

void WorkerServiceImpl::InputArrived(uint64_t id, const Status& status) {
  auto it = tasks_.find(id);
  if (it == tasks_.end()) return;
  PendingTask& task = *it->second;
  if (!status.ok() && task.error.ok()) task.error = status;
  if (--task.missing > 0) return;
  if (!task.error.ok()) {
    const Status error = task.error.WithContext(TaskContext(task.task.spec));
    AbandonMember(task.task.spec);
    tasks_.erase(it);
    Finish(id, error);
    return;
  }
  MakeReady(id);
  StartReadyTasks();
}

void WorkerServiceImpl::MakeReady(uint64_t id) {
  PendingTask* task = tasks_.at(id).get();
  // Collective members go to the communication stream, not the executor's slots.
  if (IsMember(task->task.spec)) {
    SubmitMember(task);
    return;
  }
  ready_.push(task);
}

void WorkerServiceImpl::StartReadyTasks() {
  while (running_ < threads_ && !ready_.empty()) {
    PendingTask* task = ready_.top();
    ready_.pop();
    ++running_;
    arena_.enqueue([this, task] { Execute(task); });
  }
}

std::vector<TensorMeta> WorkerServiceImpl::OutputMetas(const PendingTask& task) {
  std::vector<TensorMeta> metas;
  // On the host whatever the driver's inference said: dynamic tasks run CPU kernels.
  for (const ObjectSpec& output : task.task.outputs) metas.push_back(OnHost(output.meta));
  return metas;
}

void WorkerServiceImpl::Execute(PendingTask* task) {
  const TaskSpec& spec = task->task.spec;
  TaskRunCounters counters;
  // Inputs belong to the store or to pulls: never donate them.
  Result<std::vector<Tensor>> outputs = RunTaskKernel(
      *task->kernel, spec, task->inputs, OutputMetas(*task), KernelContextHere(),
      [](int) { return false; }, &counters);
  TaskResult result = Seal(spec, std::move(outputs));
  rpc::asio::post(io_, [this, result = std::move(result)]() mutable {
    tasks_.erase(result.task);  // releases the task's pins and pulled inputs
    --running_;
    Queue(std::move(result));
    StartReadyTasks();
  });
}

bool WorkerServiceImpl::IsMember(const TaskSpec& spec) {
  return spec.attrs.Has(kCollectiveAttr) && spec.attrs.GetInt(kGroupSizeAttr, 1) > 1;
}

void WorkerServiceImpl::SubmitMember(PendingTask* task) {
  const TaskSpec& spec = task->task.spec;
  TaskRunCounters counters;
  Result<std::vector<Tensor>> outputs = PrepareTaskOutputs(
      spec, task->inputs, OutputMetas(*task), KernelContextHere(), [](int) { return false; },
      &counters);
  const int64_t position = spec.attrs.GetInt(kPositionAttr, 0);
  if (!outputs.ok()) {
    engine_->Submit(CollectiveEngine::kDynamicStream, position, CollectiveMember{},
                    [](const Status&) {});
    const uint64_t id = spec.id.value();
    tasks_.erase(id);
    Finish(id, outputs.status().WithContext(TaskContext(spec)));
    return;
  }
  auto prepared = std::make_shared<std::vector<Tensor>>(*outputs);
  engine_->Submit(
      CollectiveEngine::kDynamicStream, position,
      CollectiveMember{spec.name, spec.op, spec.attrs, task->inputs, *std::move(outputs)},
      [this, task, prepared](const Status& status) {
        const TaskSpec& member = task->task.spec;
        TaskResult result =
            status.ok()
                ? Seal(member, std::move(*prepared))
                : TaskResult{member.id.value(), status.WithContext(TaskContext(member)), {}, {}};
        rpc::asio::post(io_, [this, result = std::move(result)]() mutable {
          tasks_.erase(result.task);
          Queue(std::move(result));
        });
      });
}

void WorkerServiceImpl::AbandonMember(const TaskSpec& spec) {
  // Its position in the communication stream must still pass, or later members would wait.
  if (IsMember(spec)) {
    engine_->Submit(CollectiveEngine::kDynamicStream, spec.attrs.GetInt(kPositionAttr, 0),
                    CollectiveMember{}, [](const Status&) {});
  }
}

WorkerServiceImpl::TaskResult WorkerServiceImpl::Seal(const TaskSpec& spec,
                                                      Result<std::vector<Tensor>> outputs) {
  // Off the io thread: a full host tier spills to disk.
  TaskResult result;
  result.task = spec.id.value();
  result.error = outputs.status();
  for (size_t j = 0; result.error.ok() && j < outputs->size(); ++j) {
    Tensor& tensor = (*outputs)[j];
    const ObjectId id = spec.outputs[j];
    std::string inline_data;
    if (tensor.bytes() <= options_.settings.inline_object_bytes) {
      inline_data.assign(static_cast<const char*>(tensor.raw_data()),
                         static_cast<size_t>(tensor.bytes()));
    }
    const int64_t bytes = tensor.bytes();
    Status sealed = store_.Put(id, std::move(tensor));
    if (!sealed.ok()) {
      result.error = sealed.WithContext(
          fmt::format("sealing output {} of {}", id.ToString(), TaskContext(spec)));
      break;
    }
    result.outputs.emplace_back(id.value(), bytes);
    result.inlines.push_back(std::move(inline_data));
  }
  return result;
}

void WorkerServiceImpl::Finish(uint64_t task, const Status& error) {
  TaskResult result;
  result.task = task;
  result.error = error;
  Queue(std::move(result));
}

void WorkerServiceImpl::Queue(TaskResult result) {
  results_.push_back(std::move(result));
  ++tasks_done_;
  if (flush_posted_) return;
  flush_posted_ = true;
  // With more tasks queued or running, more results follow shortly: send them together, at most
  // a coalescing window later. Otherwise (a lone task, someone waiting on it) send at once.
  const bool more_coming = running_ > 0 || !ready_.empty();
  if (!more_coming) {
    rpc::asio::post(io_, [this] { FlushResults(); });
    return;
  }
  flush_timer_->expires_after(kResultCoalesceWindow);
  flush_timer_->async_wait([this](const boost::system::error_code& error) {
    if (!error) FlushResults();
  });
}

void WorkerServiceImpl::FlushResults() {
  flush_posted_ = false;
  if (results_.empty() || !connection_) return;
  capnp::MallocMessageBuilder message;
  auto list = message.initRoot<proto::Envelope>().initBody().initTasksFinished().initResults(
      static_cast<unsigned>(results_.size()));
  for (unsigned i = 0; i < results_.size(); ++i) {
    const TaskResult& result = results_[i];
    auto out = list[i];
    out.setTask(result.task);
    if (!result.error.ok()) {
      rpc::ToWire(result.error, out.initError());
      continue;
    }
    auto sealed = out.initOutputs(static_cast<unsigned>(result.outputs.size()));
    for (unsigned j = 0; j < result.outputs.size(); ++j) {
      sealed[j].setId(result.outputs[j].first);
      sealed[j].setBytes(result.outputs[j].second);
      const std::string& data = result.inlines[j];
      if (!data.empty()) {
        sealed[j].setInline(
            capnp::Data::Reader(reinterpret_cast<const kj::byte*>(data.data()), data.size()));
      }
    }
  }
  results_.clear();
  connection_->Send(message);
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
  if (done_) return;
  // The scheduler sends a keepalive every heartbeat interval: silence means it is stopped, or
  // its host is gone without closing the connection.
  const auto silent = std::chrono::steady_clock::now() - last_heard_.load();
  if (silent > rpc::SchedulerSilenceLimit(options_.settings.heartbeat_timeout_ms, heartbeat_ms_)) {
    Stop(Unavailable("lost the scheduler: no word from it for {} ms",
                     std::chrono::duration_cast<std::chrono::milliseconds>(silent).count()));
    return;
  }
  const ObjectStoreStats stats = store_.stats();
  capnp::MallocMessageBuilder message;
  auto heartbeat = message.initRoot<proto::Envelope>().initBody().initHeartbeat();
  heartbeat.setHostUsed(stats.host_bytes);
  heartbeat.setHostCapacity(stats.host_capacity_bytes);
  heartbeat.setSpilledBytes(stats.spilled_bytes);
  heartbeat.setTasksRunning(running_);
  heartbeat.setTasksDone(tasks_done_);
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
    std::lock_guard lock(done_mutex_);
    if (done_) return;
    done_ = true;
    exit_reason_ = reason;
  }
  done_cv_.notify_all();
}

Status WorkerServiceImpl::Wait() {
  std::unique_lock lock(done_mutex_);
  done_cv_.wait(lock, [this] { return done_; });
  return exit_reason_;
}

}  // namespace

Result<std::unique_ptr<WorkerService>> WorkerService::Start(const WorkerServiceOptions& options,
                                                            const OpRegistry& registry) {
  auto service = std::make_unique<WorkerServiceImpl>(options, registry);
  TESSERA_RETURN_IF_ERROR(service->Init());
  return std::unique_ptr<WorkerService>(std::move(service));
}

}  // namespace tessera
