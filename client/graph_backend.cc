#include "client/graph_backend.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <thread>

#include "ops/cpu/cpu_kernels.h"
#include "worker/gpu.h"
#include "worker/task_runner.h"

namespace tessera {

namespace {

class InProcessBackend final : public GraphBackend {
 public:
  explicit InProcessBackend(std::unique_ptr<OpRegistry> registry, const ExecutorOptions& options)
      : registry_(std::move(registry)),
        executor_(*registry_, options),
        host_memory_bytes_(options.host_memory_bytes) {}

  Result<int> Register(const Graph& graph) override {
    TESSERA_ASSIGN_OR_RETURN(PreparedGraph prepared, executor_.Prepare(graph));
    prepared_.push_back(std::make_unique<PreparedGraph>(std::move(prepared)));
    return static_cast<int>(prepared_.size()) - 1;
  }

  Result<ValueMap> Run(int graph, ValueMap inputs, ValueMap* intact) override {
    ObjectMap tensors;
    for (auto& [id, value] : inputs) tensors.emplace(id, std::move(value.tensor));
    inputs.clear();  // the executor must hold the only references, so it can update in place
    ObjectMap kept;
    Result<RunResult> run = executor_.Run(*prepared_.at(static_cast<size_t>(graph)),
                                          std::move(tensors), intact ? &kept : nullptr);
    if (!run.ok()) {
      if (intact != nullptr) {
        for (auto& [id, tensor] : kept) (*intact)[id].tensor = std::move(tensor);
      }
      return run.status();
    }
    RecordTimings(graph, run->stats);
    last_peak_bytes_ = run->stats.peak_bytes;
    last_device_peak_bytes_ = run->stats.device_peak_bytes;
    const RoleBytes& roles = run->stats.role_bytes;
    last_figures_ = RunFigures{};
    last_figures_.role_peaks.assign(roles.peak.begin(), roles.peak.end());
    last_figures_.model_state_peak = roles.model_state_peak;
    last_figures_.transient_peak = roles.transient_peak;
    last_figures_.total_peak = roles.total_peak;
    last_figures_.total_with_scratch_peak = roles.total_with_scratch_peak;
    last_figures_.allocator_peak = run->stats.peak_bytes;
    last_figures_.wall_ms = run->stats.wall_ms;
    ValueMap outputs;
    for (auto& [id, tensor] : run->outputs) outputs[id].tensor = std::move(tensor);
    return outputs;
  }

  Result<Value> Upload(Tensor tensor) override { return Value{std::move(tensor), {}}; }
  Result<Value> UploadTo(Tensor tensor, Device device) override {
    if (device.is_cpu() || executor_.device() == nullptr) return Upload(std::move(tensor));
    TensorMeta meta = tensor.meta();
    meta.device = device;
    TESSERA_ASSIGN_OR_RETURN(Tensor moved, MoveTo(meta, std::move(tensor), executor_.Copier()));
    return Value{std::move(moved), {}};
  }
  Result<Tensor> Download(const Value& value) override {
    if (!value.tensor.defined()) return value.tensor;
    // A GPU's object: a host copy (the device buffer stays with the value).
    return HostCopyOf(value.tensor, executor_.Copier());
  }
  std::shared_ptr<Allocator> allocator() override { return executor_.allocator(); }
  void CapHostMemory(int64_t bytes, const std::string& source) override {
    executor_.allocator()->SetCap(bytes, source);
  }
  int64_t last_peak_bytes() const override { return last_peak_bytes_; }
  int64_t last_device_peak_bytes() const override { return last_device_peak_bytes_; }
  Result<std::vector<std::pair<WorkerId, RunFigures>>> LastRunFigures(
      int, const std::vector<WorkerId>&) override {
    return std::vector<std::pair<WorkerId, RunFigures>>{{WorkerId(), last_figures_}};
  }
  std::vector<WorkerId> workers() const override { return {}; }
  int64_t host_memory_bytes() const override {
    return host_memory_bytes_ > 0 ? host_memory_bytes_ : AvailableHostMemoryBytes();
  }
  std::string Describe() const override {
    if (executor_.device() != nullptr) {
      return fmt::format("in process on {}, {} threads", executor_.device()->Describe(),
                         executor_.threads());
    }
    return fmt::format("in process, {} threads", executor_.threads());
  }

  Result<Timeline> LastTimeline(int graph, int instances) override {
    if (graph < 0 || static_cast<size_t>(graph) >= prepared_.size()) {
      return InvalidArgument("graph handle {} was not registered with this backend", graph);
    }
    const Graph& spec = prepared_[static_cast<size_t>(graph)]->graph();
    std::vector<const RecordedRun*> chosen;
    for (auto it = runs_.rbegin(); it != runs_.rend(); ++it) {
      if (instances > 0 && static_cast<int>(chosen.size()) >= instances) break;
      if (it->graph == graph) chosen.push_back(&*it);
    }
    Timeline timeline;
    char hostname[256] = {};
    gethostname(hostname, sizeof(hostname) - 1);
    timeline.processes.push_back(TimelineProcess{WorkerId(), hostname, static_cast<int>(getpid())});
    for (auto it = chosen.rbegin(); it != chosen.rend(); ++it) {
      for (const TaskTiming& timing : (*it)->timings) {
        if (!timing.task.valid() || timing.task.value() > spec.tasks().size()) continue;
        const TaskSpec& task = spec.tasks()[timing.task.value() - 1];
        TimelineSpan span;
        span.stream = std::max(timing.thread_slot, 0);
        span.name = task.name;
        span.layer = task.layer;
        span.op = task.op;
        span.kind = ClassifyTask(task.name, task.op);
        span.bytes = timing.bytes;
        span.start_us = (*it)->start_unix_us + static_cast<int64_t>(timing.start_us);
        span.end_us =
            std::max(span.start_us, (*it)->start_unix_us + static_cast<int64_t>(timing.end_us));
        span.graph = static_cast<uint64_t>(graph);
        span.instance = (*it)->instance;
        timeline.spans.push_back(std::move(span));
      }
    }
    return timeline;
  }

 private:
  struct RecordedRun {
    int graph = 0;
    uint64_t instance = 0;  // runs of this backend, from 1
    int64_t start_unix_us = 0;
    std::vector<TaskTiming> timings;
  };
  // Keeps the timings of the latest trace_instances runs (RunStats::timings is in task-id
  // order, one per task).
  void RecordTimings(int graph, const RunStats& stats) {
    runs_.push_back(RecordedRun{graph, ++runs_recorded_, stats.start_unix_us, stats.timings});
    while (static_cast<int64_t>(runs_.size()) > std::max<int64_t>(1, trace_instances_)) {
      runs_.pop_front();
    }
  }

  int64_t trace_instances_ = Settings{}.trace_instances;
  std::deque<RecordedRun> runs_;
  uint64_t runs_recorded_ = 0;
  std::unique_ptr<OpRegistry> registry_;
  InProcessExecutor executor_;
  int64_t host_memory_bytes_ = 0;  // ExecutorOptions::host_memory_bytes
  std::vector<std::unique_ptr<PreparedGraph>> prepared_;
  int64_t last_peak_bytes_ = 0;
  int64_t last_device_peak_bytes_ = 0;
  RunFigures last_figures_;
};

class ClusterBackend final : public GraphBackend {
 public:
  ClusterBackend(Cluster& cluster, ClusterPlacement placement, std::vector<WorkerId> workers)
      : cluster_(cluster), placement_(placement), workers_(std::move(workers)) {}

  Result<int> Register(const Graph& graph) override {
    Graph placed = graph;
    if (placement_ == ClusterPlacement::kLayersRoundRobin) {
      // Pin every task of a layer to one worker, layers dealt in order of first appearance.
      std::map<std::string, WorkerId> layer_worker;
      Graph pinned;
      for (const ObjectSpec& object : graph.objects()) {
        pinned.AddObject(object.name, object.meta, object.role);
      }
      for (TaskSpec task : graph.tasks()) {
        if (!task.pinned_worker.valid()) {  // the plan's own pins stand
          auto [it, inserted] = layer_worker.emplace(task.layer, WorkerId());
          if (inserted) it->second = workers_[(layer_worker.size() - 1) % workers_.size()];
          task.pinned_worker = it->second;
        }
        pinned.AddTask(std::move(task));
      }
      for (ObjectId output : graph.OutputObjects()) pinned.MarkOutput(output);
      placed = std::move(pinned);
    }
    TESSERA_ASSIGN_OR_RETURN(GraphHandle handle, cluster_.RegisterGraph(placed));
    handles_.push_back(std::move(handle));
    return static_cast<int>(handles_.size()) - 1;
  }

  Result<ValueMap> Run(int graph, ValueMap inputs, ValueMap* intact) override {
    // Inputs moved in are handed to the instance where this driver holds them nowhere else (a
    // trainer's state), so that the workers update them in place as the plan counts; the rest
    // (held elsewhere too) are read as they are.
    std::map<ObjectId, ObjectRef> refs;
    for (auto& [id, value] : inputs) refs.emplace(id, std::move(value.ref));
    std::vector<ObjectId> handed_over;
    Result<std::map<ObjectId, ObjectRef>> run =
        cluster_.RunGraphHandingOver(handles_.at(static_cast<size_t>(graph)), refs, &handed_over);
    if (!run.ok()) {  // nothing was handed over
      if (intact != nullptr) {
        for (auto& [id, ref] : refs) inputs[id].ref = std::move(ref);
        *intact = std::move(inputs);
      }
      return run.status();
    }
    // Wait for the instance, so errors come back from Run (and intact inputs with them).
    std::vector<ObjectRef> outputs;
    for (const auto& [id, ref] : *run) outputs.push_back(ref);
    Status done = cluster_.Wait(outputs, -1);
    if (!done.ok()) {
      // Those handed over that did not come back are gone (a worker updated them in place
      // before the error); the others are as they were (cluster objects are immutable).
      if (intact != nullptr) {
        for (ObjectId id : handed_over) {
          if (refs.at(id).handed_over()) refs.erase(id);
        }
        intact->clear();
        for (auto& [id, ref] : refs) (*intact)[id].ref = std::move(ref);
      }
      return done;
    }
    ValueMap result;
    for (auto& [id, ref] : *run) result[id].ref = std::move(ref);
    return result;
  }

  Result<Value> Upload(Tensor tensor) override {
    TESSERA_ASSIGN_OR_RETURN(ObjectRef ref, cluster_.Put(tensor));
    return Value{{}, std::move(ref)};
  }
  Result<Tensor> Download(const Value& value) override { return cluster_.Get(value.ref, 120'000); }
  std::shared_ptr<Allocator> allocator() override { return allocator_; }
  int64_t last_peak_bytes() const override { return 0; }
  std::vector<WorkerId> workers() const override { return workers_; }

  Result<Timeline> LastTimeline(int graph, int instances) override {
    if (graph < 0 || static_cast<size_t>(graph) >= handles_.size()) {
      return InvalidArgument("graph handle {} was not registered with this backend", graph);
    }
    return cluster_.Timeline(instances, handles_[static_cast<size_t>(graph)].id());
  }

  Result<std::vector<std::pair<WorkerId, RunFigures>>> LastRunFigures(
      int graph, const std::vector<WorkerId>& workers) override {
    const uint64_t id = handles_.at(static_cast<size_t>(graph)).id();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (true) {
      TESSERA_ASSIGN_OR_RETURN(ClusterInfo info, cluster_.Info());
      std::vector<std::pair<WorkerId, RunFigures>> figures;
      for (WorkerId worker : workers) {
        for (const WorkerInfo& w : info.workers) {
          const RunFigures& run = w.last_run;
          if (w.id == worker && run.graph == id && run.instance > reported_[{id, worker}]) {
            figures.emplace_back(worker, run);
          }
        }
      }
      if (figures.size() == workers.size()) {
        for (const auto& [worker, run] : figures) reported_[{id, worker}] = run.instance;
        return figures;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return TimedOut("{} of {} workers reported their run of graph {} within 5 s",
                        figures.size(), workers.size(), id);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  std::string Describe() const override {
    return fmt::format(
        "cluster at {}, {} worker(s), {} placement", cluster_.address(), workers_.size(),
        placement_ == ClusterPlacement::kScheduler ? "scheduler" : "layer round-robin");
  }

 private:
  Cluster& cluster_;
  const ClusterPlacement placement_;
  const std::vector<WorkerId> workers_;
  std::vector<GraphHandle> handles_;
  std::map<std::pair<uint64_t, WorkerId>, uint64_t> reported_;  // last instance returned
  std::shared_ptr<Allocator> allocator_ = std::make_shared<AlignedHostAllocator>();
};

}  // namespace

Result<std::unique_ptr<GraphBackend>> MakeInProcessBackend(const ExecutorOptions& options) {
  TESSERA_ASSIGN_OR_RETURN(OpRegistry registry, MakeCpuOpRegistry());
  if (options.device != nullptr) TESSERA_RETURN_IF_ERROR(AddGpuKernels(registry));
  return std::unique_ptr<GraphBackend>(
      new InProcessBackend(std::make_unique<OpRegistry>(std::move(registry)), options));
}

Result<std::unique_ptr<GraphBackend>> MakeClusterBackend(Cluster& cluster,
                                                         ClusterPlacement placement) {
  TESSERA_ASSIGN_OR_RETURN(ClusterInfo info, cluster.Info());
  std::vector<WorkerId> workers;
  for (const WorkerInfo& worker : info.workers) {
    if (worker.alive) workers.push_back(worker.id);
  }
  if (workers.empty())
    return Unavailable("the cluster at {} has no alive worker", cluster.address());
  return std::unique_ptr<GraphBackend>(new ClusterBackend(cluster, placement, std::move(workers)));
}

}  // namespace tessera
