// Plan search: the parallel plan chosen by the system instead of by flags (`--plan auto`,
// `tessera plan`).
//
// A search enumerates plans of one model and global batch over a number of workers, in one
// deterministic order:
//   the tensor-parallel degree T (Megatron-LM's tensor slicing, where the model splits: each
//   candidate of T >= 2 is planned on the model's split, ModelSpec::PlannedFor), and with it
//   Megatron-LM's sequence sharding or not,
//   data-parallel ranks D x pipeline stages P (D x T x P every worker, or also fewer),
//   the schedule (P > 1: gpipe, 1f1b, interleaved with V = 2, zb-h1 where a layer splits),
//   micro-batches M (divisors of a rank's rows; M >= P for the 1f1b family),
//   the cut (P > 1, with the calibration: the balanced cut and the next ones within
//   cut_slack of its largest chunk, NearBalancedCuts over the layers' calibrated times),
//   the ZeRO stage (D > 1), offload (GPU workers),
// and the memory planner's decisions for each (recompute, keep part, swap: PlanTrainingStep under
// the base plan's caps). Each dimension is one loop of EnumerateCandidates; a new one is a new
// loop there.
//
// Every candidate is planned (PlanTrainingStep): a plan that cannot fit under the caps is refused
// there and never timed (the memory prune); the others get their predicted peak per tier
// (PredictMemory) and a simulated step (planner/step_simulation.h) on the calibrated costs. The
// ranking is by simulated step time, then the lower peak in the capped tier, then fewer workers,
// then the enumeration order: the same inputs give the same ranking.
//
// The calibration is what the costs come from (training/plan_calibration.h measures it on a
// cluster): per-layer times at the micro-batch row counts the plans use (other counts are
// interpolated per layer, or scaled in proportion beyond the measured ones), of the whole model
// and of one rank of each tensor split searched, the per-task overhead, and the links. A split
// sharding sequences runs the tensor split's layers, those on 1/T of each sequence (norms,
// residuals) timed at 1/T of the rows (the same elements): its collectives change the shapes its
// layers read, so one process cannot run a rank of it alone (ModelSpec::OneRankView).
//
// Thread safety: PlanSearch plans candidates on `threads` threads of its own; the registry is
// only read.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/model_spec.h"
#include "ops/op_registry.h"
#include "planner/memory_model.h"
#include "planner/step_graph.h"
#include "planner/step_simulation.h"
#include "planner/training_plan.h"

namespace tessera {

// The layers' times at one micro-batch row count (ProfileLayerTimes).
struct LayerTimesAtRows {
  int64_t rows = 0;
  std::vector<OpCosts> layer_ms;
};

// One rank's layer times in a tensor split over `tensor_parallel` ranks, or (tensor_parallel 1)
// in a split into `slabs` slabs of each volume (spatial parallelism): its own layers, the
// split's (ModelSpec::PlannedFor).
struct TensorSplitTimes {
  int tensor_parallel = 2;
  std::vector<LayerTimesAtRows> layers;  // as Calibration::layers
  int slabs = 1;
};

struct Calibration {
  std::vector<LayerTimesAtRows> layers;  // the whole model's; any order; distinct row counts
  // Per tensor degree T >= 2 and per slab count S >= 2 searched; distinct (T, S).
  std::vector<TensorSplitTimes> tensor_splits;
  // What a step spends per task beyond the tasks' own time on the workers (measured against a
  // step run there: training/plan_calibration.h), else in this process (StepProfile).
  double task_overhead_ms = 0;
  // What the tasks that are no layer's (optimizer updates, accumulations, reductions) take per
  // unit of the op cost model's estimate (StepProfile::other_ms_per_unit); 0: the layers'
  // forwards' rate (EstimateTaskTimes).
  double other_ms_per_unit = 0;
  // What a step on the workers takes beyond its tasks (its inputs sent, the instance started on
  // every worker, their reports collected): step_overhead_ms, plus step_overhead_per_worker_ms
  // for each worker past the first (each is started and reports), plus
  // step_overhead_per_task_ms for each task of the worker that runs the most (a worker readies
  // and retires each of its tasks): StepOverheadMs. Fitted on the probe steps' timelines
  // (training/plan_calibration.h); 0: in this process.
  double step_overhead_ms = 0;
  double step_overhead_per_worker_ms = 0;
  double step_overhead_per_task_ms = 0;
  // The workers' compute time over the profile's (this process's): every task's time is
  // scaled by it; 1: the same.
  double compute_scale = 1;
  StepLinks links;
  ComputeSharing sharing;  // workers sharing one machine's compute
  // Probe steps the workers could not run (a worker's cap below the probe's step), whose figures
  // stay at their defaults: such a calibration holds for these caps only, and is not cached
  // (training/auto_plan.h). Not part of the cache file (a cached calibration has none).
  int probes_failed = 0;
  // The probe steps on the workers the figures above were fitted on, as measured (each round's
  // step time; none: the probe failed), in the order the calibration made them: kept so that the
  // same measurements can be fitted again when the simulation changes
  // (training/plan_calibration.h: RefitCalibration). Empty without workers.
  struct ProbeRecord {
    std::string what;
    std::vector<double> ms;
    std::vector<double> outside_ms;  // per round, what its steps took outside their tasks
  };
  std::vector<ProbeRecord> probe_steps;
  std::vector<WorkerId> probe_workers;  // the workers they ran on (a plan's ids order ties)
  // links.collective as measured, before the probes fitted a pair's wait into its latency.
  CollectiveLink measured_collective;

  // The layer times of a rank of the split over `tensor_parallel` ranks, or into `slabs` slabs;
  // null when none were measured.
  const TensorSplitTimes* SplitTimes(int tensor_parallel, int slabs = 1) const;
};

// How many workers run `graph`'s tasks and the most tasks one of them runs (tasks pinned to no
// worker counted as one worker's).
struct WorkerLoad {
  int64_t workers = 0, most_tasks = 0;
};
WorkerLoad WorkerLoadOf(const Graph& graph);
// What a step of `graph` takes beyond its tasks by `calibration` (Calibration::step_overhead_ms).
double StepOverheadMs(const Calibration& calibration, const Graph& graph);

// Per layer of the whole model, its times at `rows` micro-batch rows: a measured row count's,
// else interpolated linearly between the nearest measured counts below and above, else the
// nearest one's scaled by rows over its rows. InvalidArgument when nothing was measured or
// rows < 1.
Result<std::vector<OpCosts>> LayerTimesAt(const Calibration& calibration, int64_t rows);
// The same for `model`: the whole model (LayerTimesAt) or a split of it planned for T tensor
// ranks (its TensorSplitTimes; sharding sequences, each sequence-sharded layer's times at rows / T
// of them: as many elements as its 1/T of each sequence).
// InvalidArgument when the calibration has no times for its degree or not one per layer.
Result<std::vector<OpCosts>> LayerTimesOf(const Calibration& calibration, const ModelSpec& model,
                                          int64_t rows);

struct SearchSpace {
  int workers = 1;
  // Plans on fewer workers too (D x P < workers): on machines whose workers share cores, fewer
  // may be faster.
  bool fewer_workers = false;
  std::vector<int> zero_stages = {0, 1, 2, 3};
  std::vector<PipelineSchedule> schedules = {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B,
                                             PipelineSchedule::kInterleaved,
                                             PipelineSchedule::kZbH1};
  int max_micro_batches = 16;
  int max_pipeline_stages = 0;  // 0: as many as the workers and layers allow
  // Cuts tried per pipeline shape (the balanced one included), and how much larger than the
  // balanced cut's their largest chunk may be.
  int cuts = 3;
  double cut_slack = 0.25;
  // Dimensions the user fixed (0: searched): only plans with this many stages, micro-batches,
  // virtual stages.
  int pipeline_stages = 0, micro_batches = 0, virtual_stages = 0;
  std::vector<int> chunk_layers;  // a given cut (--stage-layers): only plans of its chunks
  // Tensor-parallel degrees T (D x T x P workers). Empty: 1 and every T >= 2 of the workers'
  // count (with fewer_workers, up to it) over which the model splits. A given degree the model
  // cannot split over is an error of the search.
  std::vector<int> tensor_parallel;
  // With T >= 2: Megatron-LM's sequence sharding or not, where the model shards sequences and T
  // divides the sequence length.
  std::vector<bool> shard_sequence = {false, true};
  // Slab counts S (spatial parallelism, a volume model's: ModelSpec::split_into_slabs; D x S x P
  // workers, without tensor parallelism). Empty: 1 and every S >= 2 of the workers' count (with
  // fewer_workers, up to it) into which the model's volumes split, unless tensor_parallel is
  // given without 1. A given count the model cannot split into is an error of the search.
  std::vector<int> slabs;
  int threads = 1;  // planning threads (candidates are independent)
};

// A candidate's dimensions; the flags that would run it by hand.
struct PlanChoice {
  int data_parallel = 1, pipeline_stages = 1, virtual_stages = 1, micro_batches = 1;
  int zero_stage = 0;
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  OffloadMode offload = OffloadMode::kNone;
  std::vector<int> chunk_layers;  // the cut (ParallelConfig::chunk_layers); empty: balanced
  int tensor_parallel = 1;        // T
  // Megatron-LM's sequence parallelism over the T tensor ranks (ParallelConfig::shard_sequence).
  bool shard_sequence = false;
  // ParallelConfig::settle_reductions: set where the calibration found workers sharing a
  // machine and the plan reduces each micro-batch's gradients (ZeRO-2/3, several micro-batches
  // over several data-parallel ranks). Not part of the name.
  bool settle_reductions = false;
  // S: each volume in S slabs over S workers of each data-parallel rank (spatial parallelism;
  // ParallelConfig's sequence ranks, attending by kHalo). data_parallel counts the row groups.
  int slabs = 1;
  int workers() const { return data_parallel * slabs * tensor_parallel * pipeline_stages; }
  // "D4 x P1 M2 ZeRO-1", "D1 x P4 zb-h1 M8", "D2 x P2 1f1b M4 cut 2+4 ZeRO-1",
  // "D4 x T8 x P12 1f1b M384 ZeRO-1", "D4 x T8 SP x P12 1f1b M384 ZeRO-1" (sequence-sharded),
  // "D1 x S4 x P1 M1 ZeRO-0" (four slabs)
  std::string Name() const;
  // "--workers 4 --micro-batches 2 --zero-stage 1" (with --pipeline-stages, --schedule,
  // --virtual-stages, --stage-layers, --tensor-parallel, --spatial-parallel, --offload,
  // --settle-reductions when they differ from the defaults; no --workers for one).
  std::string Flags() const;
};

struct RankedPlan {
  PlanChoice choice;
  ParallelConfig parallel;  // as planned (no workers bound), for the caller to run
  double step_ms = 0;
  SimulatedWorker critical;  // the worker that ends last: its compute and waits
  Bottleneck bottleneck = Bottleneck::kCompute;
  // The largest worker's peak per tier (MemoryTier order) the plan was fitted and checked by:
  // the larger of two orders' (below), so that a plan under a cap stays under it whichever of
  // them a run follows.
  std::array<int64_t, kMemoryTiers> peak_bytes{};
  // The largest worker's expected peak per tier: the simulated step's (PredictTimedMemory: its
  // order, what other workers send arriving at its simulated time), what a run is predicted to
  // show; the executor's untimed order's where the timed prediction failed. The untimed order
  // (every task a unit of time) runs a stage's neighbours as fast as the stage itself, so what
  // they send can pile up there beyond what a run sees (a GPipe stage of tensor-parallel pairs
  // receives the next stage's backward gradients faster than it consumes them).
  std::array<int64_t, kMemoryTiers> expected_peak_bytes{};
  // Of the compute tier, the two orders' peaks: the executor's untimed order's and the simulated
  // step's (0: not predicted).
  int64_t untimed_peak_bytes = 0, timed_peak_bytes = 0;
  int recomputed_layers = 0, swapped_layers = 0, partly_kept_layers = 0;
  std::string memory_reason;
};

struct RefusedPlan {
  PlanChoice choice;
  std::string reason;
  // Memory refusals: how far the plan stays over its tier's cap with every activation
  // recomputed (0 for refusals of other kinds).
  int64_t shortfall_bytes = 0;
  MemoryTier tier = MemoryTier::kHost;
};

struct PlanSearchResult {
  std::vector<RankedPlan> ranked;  // best first
  std::vector<RefusedPlan> refused;
  // The splits not searched, each "T3: why" or "S2: why" (PlannedModels' left_out).
  std::vector<std::string> left_out;
  int considered = 0;
  double search_ms = 0;
};

// The ranked plans of `model` for `base` (its batch, seq_len, optimizer, device and memory caps;
// its parallel part is what the search fills in). Infeasible when no candidate fits, naming the
// closest (smallest shortfall), by how much, and what would fix it; InvalidArgument for a space
// without workers or a calibration without layer times.
Result<PlanSearchResult> PlanSearch(const ModelSpec& model, const TrainingPlan& base,
                                    const SearchSpace& space, const Calibration& calibration,
                                    const OpRegistry& registry);

// The simulated step of `step` (a plan of `model`, the model it was planned on: a split one for
// T >= 2; PlanTrainingStep's result) on the calibrated costs: its layers' times at its
// micro-batch rows (LayerTimesOf), the calibration's overheads
// (the step's added to step_ms), links and sharing; `disk` the plan's swap-file link and copy
// cost (MemoryCaps).
Result<SimulatedStep> SimulatePlannedStep(const StepGraph& step, const ModelSpec& model,
                                          const MemoryCaps& disk, const Calibration& calibration,
                                          const OpRegistry& registry);

// The candidates a search plans, in its order (exposed for tests and `tessera plan --list`).
// Without a calibration (or given a cut) no cuts beyond the balanced one (or the given one).
// Degrees the model does not split over are left out, and with a calibration, unless the space
// gives them, degrees it holds no layer times for (TensorSplitTimes).
std::vector<PlanChoice> EnumerateCandidates(const ModelSpec& model, const TrainingPlan& base,
                                            const SearchSpace& space,
                                            const Calibration* calibration = nullptr);

// The models a search plans its candidates on: the whole model (T 1) and its splits
// (ModelSpec::PlannedFor) for the space's tensor-parallel degrees, without and with sequence
// sharding, then its splits into the space's slab counts, in the search's order (T 1 alone on GPU
// workers: the split layers run on CPU workers only). A degree or slab count the model does not
// split over is left out, unless
// the space gives it (then the split's error, naming the degree; of the sharded split only when
// the space asks for sharding alone).
struct PlannedModel {
  int tensor_parallel = 1;
  bool shard_sequence = false;
  ModelSpec model;
  int slabs = 1;  // a split into slabs (spatial parallelism)
};
// `left_out` (if given) gets why each split the space would hold was not planned: "T3: ..." (the
// split's error, or GPU workers), "S2: ..." (the same for slabs).
Result<std::vector<PlannedModel>> PlannedModels(const ModelSpec& model, const TrainingPlan& base,
                                                const SearchSpace& space,
                                                std::vector<std::string>* left_out = nullptr);

// The table `tessera plan` and `--plan auto` print: the top `top` plans with their predicted step
// time, expected peak per tier (RankedPlan::expected_peak_bytes) and bottleneck, the refusals'
// count, and the splits not searched, why.
std::string DescribeSearch(const PlanSearchResult& result, int top);

}  // namespace tessera
