// Where an example driver's training runs, from its flags (examples/common/flags.h):
//
//   Runtime   the settings (TESSERA_* environment, core/settings.h) with the log level applied,
//             the in-process executor's options (--threads), and the device (--device; a GPU in
//             this process is opened here, GPU workers open their own);
//   Session   this process, a local cluster of worker processes it starts (--workers N: CPU or
//             GPU workers), or a running cluster (--address, --token-file); owns the cluster,
//             makes the graph backend a Trainer runs on, and connects again after a lost
//             scheduler (recovery);
//   MakeRecovery  the StepRecovery of --max-restarts (training/recovery.h) on the session's
//             cluster.
//
// Every line printed goes to stderr prefixed "<program>: ", so stdout stays a driver's own.
// Not thread-safe: one driver thread.
#pragma once

#include <memory>
#include <string>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "core/device.h"
#include "core/settings.h"
#include "core/status.h"
#include "examples/common/flags.h"
#include "model/model_spec.h"
#include "planner/step_graph.h"
#include "training/recovery.h"
#include "worker/in_process_executor.h"

namespace tessera::examples {

struct Runtime {
  Settings settings;
  ExecutorOptions executor;  // this process's executor (with --device cuda: on its GPU)
  Device device;             // --device (a GPU: this process's, or each GPU worker's own)
  bool gpu_workers = false;  // --device cuda with --workers or --address
};

// Reads the settings, applies the log level, parses --device and opens this process's GPU when
// it trains on one. Errors name the setting or flag.
Result<Runtime> OpenRuntime(const CommonFlags& flags);

class Session {
 public:
  // Connects to --address, or starts a local cluster of --workers processes (printing its
  // dashboard), or stays in this process. The cluster's errors, naming the address.
  static Result<std::unique_ptr<Session>> Open(const CommonFlags& flags, const Runtime& runtime,
                                               std::string program);

  // The backend a Trainer runs on (once; later calls make another one on the same cluster).
  Result<std::unique_ptr<GraphBackend>> MakeBackend();
  // Null in process.
  Cluster* cluster() const { return cluster_.get(); }
  const Settings& settings() const { return runtime_.settings; }
  ClusterPlacement placement() const;
  // A connected cluster's scheduler came back (restarted by its supervisor): drops the old
  // Cluster and connects again for up to retry_ms. The error names the address.
  Result<Cluster*> Reconnect(int retry_ms);

 private:
  Session(const CommonFlags& flags, const Runtime& runtime, std::string program);
  Status Start();

  const CommonFlags& flags_;
  const Runtime& runtime_;
  const std::string program_;
  std::unique_ptr<Cluster> cluster_;
};

// On a running cluster (--address) without --workers, a plan of one data-parallel rank (no
// pipeline, no layer placement) uses the workers that are there: as many ranks as alive workers
// (GPU workers for a GPU plan) the batch splits into, said on stderr ("<program>: the cluster at
// ... has N workers: ..."); with --balance profile the layers are profiled again for the ranks'
// rows. Otherwise the plan is left as it is (a cluster of one worker, or a batch that does not
// split: said why).
Status UseTheClustersWorkers(const CommonFlags& flags, Session& session, const ModelSpec& model,
                             const Runtime& runtime, const char* program, TrainingPlan& plan);

// --plan auto: the plan search (training/auto_plan.h) over the session's workers (--workers N,
// the running cluster's alive workers, or this process), with the plan flags given fixing their
// dimension; calibrated on this session (cached under the setting cache_dir); the best plans and
// the choice are printed on stderr, and `plan` becomes the chosen one. Nothing with --plan flags.
// InvalidArgument for flags the search cannot honour (--placement layers); the search's errors
// (Infeasible: no plan fits, with the closest and the fix).
Status ChooseThePlan(const CommonFlags& flags, Session& session, const ModelSpec& model,
                     const Runtime& runtime, const char* program, TrainingPlan& plan);

// --max-restarts K: the recovery of `model` and `plan` on the session's cluster, from the
// checkpoints of --checkpoint-dir (null when K is 0). With --address a lost scheduler is
// recovered by connecting again for scheduler_grace_ms.
std::unique_ptr<StepRecovery> MakeRecovery(const CommonFlags& flags, Session& session,
                                           const Settings& settings, const ModelSpec& model,
                                           const TrainingPlan& plan);

}  // namespace tessera::examples
