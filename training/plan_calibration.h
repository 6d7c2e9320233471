// Calibrating a cluster for the plan search (planner/plan_search.h), and keeping the result so
// the next run on the same machine, model and shape does not measure it again.
//
// A calibration is:
//   * the layers' forward, backward and weight-half times at every micro-batch row count the
//     search's candidates use (ProfileStep in this process, split backwards, at that shape:
//     training/layer_profile.h), and the per-task overhead measured beside them; for each
//     tensor-parallel degree T searched, the same for one rank of the model's split over T
//     ranks (ModelSpec::OneRankView: the rank's kernels at its shapes, in this process, without
//     the split's collectives, which the simulation prices on the link); and the rate of the
//     tasks that are no layer's (optimizer updates, gradient norms: StepProfile::
//     other_ms_per_unit, the median over the profiles), which move bytes where layers multiply;
//   * the collective link among the workers (MeasureCollectiveLink over up to the plan's
//     workers: its latency and all-reduce bandwidth), and the push link between the first two
//     (MeasurePushLink: what a pipeline's objects take; StepLinks::point_to_point). One worker:
//     none;
//   * on a cluster, probe steps that fit what the profile in this process cannot see: what each
//     probe's steps take outside their tasks (its timeline: the step less the span of its tasks),
//     over every probe a constant, a cost per worker past the first and a cost per task of the
//     worker that runs the most (Calibration::step_overhead_ms, step_overhead_per_worker_ms,
//     step_overhead_per_task_ms); one rank on one worker at two
//     row counts (one rank's of the widest data-parallel plan, and twice that): the worker's
//     steps less that as a scale of the profiled work (Calibration::compute_scale; without
//     timelines, a recording made before they were kept, the two steps fit the scale and a
//     constant per step); every worker a data-parallel rank at once:
//     when that step is slower than the simulation says, the workers share a machine's compute,
//     and the capacity (ComputeSharing) is bisected so the simulation gives the measured step;
//     every worker a stage of one pipeline (1F1B, micro-batches of one row): what an object
//     pushed between workers waits while they share the machine (its reader must be scheduled:
//     StepLinks::shared_push_latency_us), bisected alike;
//     for each tensor split of T calibrated that divides the workers, every worker a tensor
//     rank of n/T groups of T at once, at one row a micro-batch (the most collectives a step's
//     compute): what a collective of T members waits for its peers while the workers share the
//     machine (for pairs the collective latency, for more StepLinks::group_latency: a member
//     waits for more peers to be scheduled), bisected alike when that step is slower than the
//     idle link says; where the model shards sequences (Megatron-LM's sequence parallelism), the
//     same groups sharding them: what their reduce-scatters and all-gathers wait
//     (StepLinks::sequence_shard_latency; peers arrive closer together after the little compute
//     between such a pair); for each slab count S calibrated that divides the workers, every
//     worker a slab of n/S volumes split into S at once, at one row a micro-batch: what their
//     halo passes and exchanged norm statistics wait (StepLinks::exchange_latency). The capacity
//     and the latencies are fitted in turn until none moves (each probe's step depends on all).
//     Then, where the workers make two stages or more of tensor pairs (or groups) or of slabs,
//     the same groups as the stages of one pipeline (1F1B, micro-batches of one row): what their
//     collectives wait inside a pipeline (StepLinks::staged_latency), bisected from the groups'
//     own figure with every other figure fixed. Last, every worker a ZeRO-3 rank at once, at one
//     row a micro-batch: what a parameter gather of n waits beside the compute while the workers
//     share the machine (StepLinks::gather_latency: where two share a core they compute in
//     turns, and a gather's members arrive a turn apart), bisected with every other figure
//     fixed.
// Probes run zeros at a zero learning rate (training/layer_profile.h's way). Every measurement is
// made in CalibrationRequest::rounds rounds, each round in another order (the shapes and the
// probes rotated), and a figure is the median of its rounds': a machine whose speed moves for a
// while (another process, the host of a virtual machine) moves one round, not the figure, and a
// fit on figures (a scale and a constant; a latency or capacity bisected from one step) does not
// carry one round's noise into every plan's prediction.
//
// The cache: one JSON file per key under the cache directory (setting cache_dir, else
// $XDG_CACHE_HOME/tessera, else ~/.cache/tessera), written atomically. The key names what the
// figures depend on: the model's layers (names, ops, parameter counts), the sequence length, the
// device, the row counts, the workers, this host and its threads, the calibration's method and
// rounds. A file of another key, or one that cannot be read, is measured again (and the reason
// said).
//
// Thread safety: uses the backend like any caller of it (one call at a time).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "core/ids.h"
#include "core/status.h"
#include "model/model_spec.h"
#include "planner/plan_search.h"
#include "worker/in_process_executor.h"

namespace tessera {

// The distinct micro-batch row counts of EnumerateCandidates(model, base, space) without
// tensor parallelism or slabs, ascending.
std::vector<int64_t> CandidateRows(const ModelSpec& model, const TrainingPlan& base,
                                   const SearchSpace& space);

// A split to profile: its tensor degree (or 1 and its slab count) and its candidates'
// micro-batch row counts (ascending).
struct TensorSplitRows {
  int tensor_parallel = 2;
  std::vector<int64_t> rows;
  int slabs = 1;
};
// Per degree T >= 2 and per slab count S >= 2 among EnumerateCandidates(model, base, space),
// ascending.
std::vector<TensorSplitRows> CandidateTensorSplitRows(const ModelSpec& model,
                                                      const TrainingPlan& base,
                                                      const SearchSpace& space);

struct CalibrationRequest {
  std::vector<int64_t> rows;                   // the row counts to profile the layers at
  std::vector<TensorSplitRows> tensor_splits;  // one rank of each split, at its row counts
  std::vector<WorkerId> workers;  // the cluster's workers the plans use (empty: this process)
  // Which of them share cores when they are bound to cores of their own (CoreGroupsOf); empty:
  // they share the whole machine. The probes fit the capacity of ComputeSharing with these groups.
  std::vector<CoreGroup> core_groups;
  int profile_steps = 4;  // timed steps per row count (after one untimed)
  int probe_steps = 5;    // timed steps per probe on the workers (after two untimed)
  // Every measurement (each shape's layer profile, the collective link, each probe step) is made
  // in this many rounds, each round in another order; a figure is the median of its rounds'.
  int rounds = 3;
};

// The groups of `workers` that share cores (ComputeSharing::groups): workers on one host whose
// CPU sets (WorkerInfo::cpus) overlap are one group, its share its cores over all the groups'.
// Empty (one group of all) when every worker may run on the same CPUs, when a worker's set is
// unknown or unreadable, or when a worker is not in `cluster`.
std::vector<CoreGroup> CoreGroupsOf(const std::vector<WorkerInfo>& cluster,
                                    const std::vector<WorkerId>& workers);

// `workers` reordered so that consecutive ones are on different groups of cores (the first of
// each group in turn, then the second of each, ...): a plan's neighbouring ranks (a tensor pair,
// a stage's ranks) then run side by side rather than taking turns on one core, whichever order
// the workers joined in. `workers` as given when `groups` is empty.
std::vector<WorkerId> InterleaveCoreGroups(const std::vector<WorkerId>& workers,
                                           const std::vector<CoreGroup>& groups);

// A new backend on the cluster (each probe's trainer owns one).
using BackendFactory = std::function<Result<std::unique_ptr<GraphBackend>>()>;

// Measures a calibration: the layer profile in this process; with `make_backend` and workers,
// the link and the probes there. `progress` (may be null) hears a line per measurement. Errors
// name what was measured ("calibrating the layers at 4 rows: ...").
Result<Calibration> Calibrate(const ModelSpec& model, const TrainingPlan& base,
                              const CalibrationRequest& request, const ExecutorOptions& executor,
                              const BackendFactory& make_backend,
                              const std::function<void(const std::string&)>& progress = nullptr);

// The calibration's figures fitted again on the probe steps it recorded (Calibration::
// probe_steps), with no worker: for when the simulation, or the way it is fitted, changes and the
// same measurements should decide. `request` must make the same probes (the same splits and
// rows; its workers, when it names none, the recorded Calibration::probe_workers, whose ids order
// a simulated step's ties as they did). InvalidArgument when it records none or other probes.
Result<Calibration> RefitCalibration(
    const ModelSpec& model, const TrainingPlan& base, const CalibrationRequest& request,
    Calibration recorded, const std::function<void(const std::string&)>& progress = nullptr);

// What a calibration depends on, as text (the cache file holds it) and as a file name.
std::string CalibrationKey(const ModelSpec& model, const TrainingPlan& base,
                           const CalibrationRequest& request, int threads);
std::string CalibrationPath(const std::string& cache_dir, const std::string& key);
// The cache directory: `setting` when given, else $XDG_CACHE_HOME/tessera, else
// $HOME/.cache/tessera, else /tmp/tessera/cache.
std::string DefaultCacheDir(const std::string& setting);

// Writes the calibration and its key as JSON, atomically, making the directory if needed.
Status SaveCalibration(const std::string& path, const std::string& key,
                       const Calibration& calibration);
// NotFound when there is no file; DataLoss naming the path when it cannot be parsed;
// InvalidArgument when it holds another key (the cluster, model or shape changed); an empty
// `key` takes any.
Result<Calibration> LoadCalibration(const std::string& path, const std::string& key);

}  // namespace tessera
