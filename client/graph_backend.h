// GraphBackend: where a driver's graphs run and its values live.
//
// A trainer plans graphs (planner/) and runs them step after step. The backend decides where:
//   - InProcessBackend: on this process's InProcessExecutor; values are host tensors, and state
//     moved into a run is updated in place (donation);
//   - ClusterBackend: on a cluster's workers through RegisterGraph/RunGraph; values are
//     ObjectRefs, so model state stays on the workers between steps and only what the driver
//     asks for (the loss) comes back.
// Placement on a cluster: by the scheduler (the graph's tasks follow their inputs, so a
// single-worker plan runs on one worker), or layer by layer round-robin over the workers (each
// layer's tasks pinned to one worker), which moves activations and gradients between workers
// and is how tests check that a split run computes exactly what a single process does.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "client/cluster.h"
#include "core/graph.h"
#include "core/status.h"
#include "core/tensor.h"
#include "core/timeline.h"
#include "ops/op_registry.h"
#include "worker/in_process_executor.h"

namespace tessera {

// A tensor living in a backend.
struct Value {
  Tensor tensor;  // InProcessBackend
  ObjectRef ref;  // ClusterBackend
  bool defined() const { return tensor.defined() || ref.valid(); }
};
using ValueMap = std::map<ObjectId, Value>;

class GraphBackend {
 public:
  virtual ~GraphBackend() = default;
  // Prepares a graph for repeated runs; returns its handle.
  virtual Result<int> Register(const Graph& graph) = 0;
  // Runs one instance. Inputs are moved in (a backend may update them in place). On error,
  // `intact` (when given) receives the inputs that are still valid.
  virtual Result<ValueMap> Run(int graph, ValueMap inputs, ValueMap* intact = nullptr) = 0;
  virtual Result<Value> Upload(Tensor tensor) = 0;
  // Upload, placed on `device` where the backend can: in process, a GPU object is copied to the
  // executor's GPU now (a model's state would otherwise wait on the host, all of it at once,
  // until the first run moved it); a cluster's workers move bytes to their GPU when a task
  // takes them.
  virtual Result<Value> UploadTo(Tensor tensor, Device device) {
    (void)device;
    return Upload(std::move(tensor));
  }
  virtual Result<Tensor> Download(const Value& value) = 0;
  // Host allocator for tensors made to be uploaded.
  virtual std::shared_ptr<Allocator> allocator() = 0;
  // Peak host bytes of the last run, when the backend can tell (0 otherwise).
  virtual int64_t last_peak_bytes() const = 0;
  // Peak bytes on the GPU during the last run: in process with a GPU; 0 otherwise (a cluster's
  // GPU workers do not report theirs).
  virtual int64_t last_device_peak_bytes() const { return 0; }
  virtual std::string Describe() const = 0;
  // Each worker's figures for the last run of `graph` (peak bytes by role, bytes sent); in
  // process, one entry with an invalid worker id. On a cluster the figures come with each
  // worker's InstanceFinished; this waits (up to a few seconds) until every one of `workers`
  // reported a run of `graph` newer than the one this call last returned.
  virtual Result<std::vector<std::pair<WorkerId, RunFigures>>> LastRunFigures(
      int graph, const std::vector<WorkerId>& workers) = 0;
  // The spans of the latest `instances` runs of `graph` (core/timeline.h), oldest first: in
  // process from the executor's task timings (the last trace_instances runs are kept; one
  // process, invalid worker id), on a cluster from the scheduler (Cluster::Timeline).
  virtual Result<Timeline> LastTimeline(int graph, int instances) = 0;
  // The workers a plan may pin tasks to, in a stable order (empty in process: one executor).
  virtual std::vector<WorkerId> workers() const = 0;
  // Host memory this process may give the plan's host-tier state: in process, the executor's
  // limit; 0 on a cluster (each worker's store holds its own objects under its own capacity).
  virtual int64_t host_memory_bytes() const { return 0; }
  // Holds the host memory the backend's runs and uploads take under `bytes` from now on (0: no
  // cap): a plan's host-tier cap, which the allocator then enforces (an allocation that would
  // pass it fails its run, naming the cap and `source`, instead of the process running out of
  // memory mid-step). In process: the executor's allocator (what the memory model counts: the
  // state uploaded, the inputs, every intermediate and kernel's scratch). A cluster's workers
  // hold theirs under the cap they were started with (`tessera worker --host-cap-gib`): nothing
  // to do here.
  virtual void CapHostMemory(int64_t bytes, const std::string& source) {
    (void)bytes;
    (void)source;
  }
};

// InProcessExecutor on a registry with CPU kernels.
Result<std::unique_ptr<GraphBackend>> MakeInProcessBackend(const ExecutorOptions& options);

enum class ClusterPlacement {
  kScheduler,         // tasks unpinned: they follow their inputs
  kLayersRoundRobin,  // each layer's unpinned tasks pinned to one worker, layers round-robin
};

// Runs on `cluster` (which must outlive the backend).
Result<std::unique_ptr<GraphBackend>> MakeClusterBackend(
    Cluster& cluster, ClusterPlacement placement = ClusterPlacement::kScheduler);

}  // namespace tessera
