// WorkerService: one worker process's runtime.
//
// A worker joins the scheduler (Hello with the cluster token), reports heartbeats, and runs the
// tasks it is dispatched:
//   1. inputs are gathered: carried inline in the dispatch, found in the local object store, or
//      pulled from their holder over the data plane (all pulls of a task run concurrently);
//   2. when all are present the task waits in a ready queue ordered by priority; up to `threads`
//      tasks run at once on the worker's TBB arena (kernels parallelise inside it too);
//   3. outputs are sealed into the object store (which spills to disk past its capacity), and
//      the result goes back to the scheduler, small outputs inline. Results of tasks finishing
//      close together share one message.
// The store's objects are served to peers over the data plane; the scheduler tells the worker
// when to free them.
//
// Threads: the io thread owns the control connection and all bookkeeping; kernels run on the
// arena; data-plane callbacks arrive on its progress thread and are handed to the io thread.
// Lifetime: Wait() returns when the scheduler says shut down or the connection is lost; the
// destructor stops everything.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/device_runtime.h"
#include "core/gpu_use.h"
#include "core/rpc/address.h"
#include "core/settings.h"
#include "core/status.h"
#include "ops/op_registry.h"

namespace tessera {

struct WorkerServiceOptions {
  rpc::Address scheduler;
  std::string token;
  int threads = 0;  // 0: one per core
  int64_t host_capacity_bytes = int64_t{8} << 30;
  // The cap on the host memory the worker's tasks and objects take at once (its allocator's:
  // core/allocator.h); 0: none. A plan's --host-memory-gib plans a step under it; an allocation
  // that would pass it fails its task, naming the cap (the worker goes on).
  int64_t host_cap_bytes = 0;
  std::string spill_dir;  // empty: no spilling
  std::string data_host = "127.0.0.1";
  int connect_timeout_ms = 5000;
  Settings settings;
  // The GPU this worker owns (worker/gpu.h's OpenGpu), or null for a CPU worker. Graph parts
  // run their kCuda tasks on it (the registry must hold the CUDA kernels); objects that live on
  // it stay there between instances (the store's device tier) and are copied to the host only
  // to leave the worker (served, pushed, reported inline) or to cross a host communicator.
  std::shared_ptr<DeviceRuntime> device;
  // Reads that GPU's utilisation and memory (worker/gpu.h's OpenGpuMeter) for each heartbeat;
  // null: the heartbeat carries no GPU figures. A sample that fails is left out of its heartbeat
  // (the first failure is logged).
  std::shared_ptr<GpuMeter> gpu_meter;
  // Loads a plugin the scheduler sent (ops/plugin.h; LoadPlugin: its name, sha256 and library)
  // and adds its ops and kernels to the registry the worker runs with (worker_main: PluginLoader).
  // Null: this worker loads none, and graphs naming one fail here, saying so.
  std::function<Status(std::string_view name, std::string_view sha256, std::string library)>
      load_plugin;
};

// A worker process's plugin loading (WorkerServiceOptions::load_plugin): writes the library into
// `dir` and loads it (LoadPluginBytes), then adds it to `registry` for `devices`, once per plugin
// however often it is sent (a worker that joins a restarted scheduler is sent them again).
// `registry` must outlive the function.
std::function<Status(std::string_view, std::string_view, std::string)> PluginLoader(
    OpRegistry& registry, std::vector<DeviceKind> devices, std::string dir);

class WorkerService {
 public:
  // Joins the cluster. Unavailable when the scheduler cannot be reached or refuses the join
  // (the message says why, e.g. an invalid token).
  static Result<std::unique_ptr<WorkerService>> Start(const WorkerServiceOptions& options,
                                                      const OpRegistry& registry);
  virtual ~WorkerService() = default;
  // Blocks until the worker should exit; returns why (OK for a requested shutdown).
  virtual Status Wait() = 0;
  virtual uint64_t id() const = 0;
  virtual const std::string& data_address() const = 0;
};

}  // namespace tessera
