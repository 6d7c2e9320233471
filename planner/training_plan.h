// Training plans: what the planner is asked to build (planner/step_graph.h builds it).
//
// A TrainingPlan is the global batch, the sequence length, the optimizer, the device the workers
// compute on, and a ParallelConfig: how the step is spread over workers. It is plain data,
// copied freely; Validate checks it against a model before anything is planned.
//
// Names (one per concept, here, in the planner and in docs/architecture.md):
//   rank             one data-parallel member of a pipeline stage; `data_parallel` ranks per
//                    stage, numbered 0 .. data_parallel - 1 (N in formulas, e.g. Ψ/N)
//   micro-batch      one of the `micro_batches` slices of a rank's rows run one after the other
//                    in a step: gradient accumulation, and what flows through a pipeline
//                    (M in formulas; the examples' flag is --micro-batches)
//   micro-batch rows the rows of one micro-batch: batch / (data_parallel x micro_batches)
//   pipeline stage   one of `pipeline_stages` groups of ranks, each running a contiguous part of
//                    the layers (P in formulas); `virtual_stages` chunks per stage (V)
//   tensor rank      one of `tensor_parallel` ranks a layer is split over (T in formulas;
//                    Megatron-LM's tensor slicing, model/model_spec.h's TensorParallelLayer):
//                    with T > 1 a stage has T x data_parallel ranks, rank r being tensor rank
//                    r % T of data-parallel rank r / T (the tensor ranks side by side, as on
//                    one node)
//   worker           the process a rank of a stage runs on:
//                    workers[stage * ranks_per_stage() + rank]
//   group            a layer's flat parameter group (model/model_spec.h), what ZeRO shards;
//                    its shard r is what rank r holds of it
//
// Thread safety: plain values; a const plan may be read from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/device.h"
#include "core/ids.h"
#include "core/status.h"
#include "model/model_spec.h"
#include "planner/pipeline_schedule.h"

namespace tessera {

struct OptimizerConfig {
  // kOneBitAdam: 1-bit Adam (Tang et al. 2021, DeepSpeed's OnebitAdam): Adam without bias
  // correction for freeze_step steps (gradients all-reduced as usual), then the variance frozen
  // and each rank's momentum averaged by an error-feedback compressed all-reduce
  // (collectives/compressed.h) in place of the gradients'. The trainer plans both phases' steps
  // (compressed_phase false, then true) and runs the second after freeze_step steps.
  // kZeroOneAdam: 0/1 Adam (Lu et al. 2022, DeepSpeed's ZeroOneAdam; planner/zero_one_adam.h):
  // up to var_freeze_step the variance is updated at exponentially spaced steps (from every step,
  // the interval doubling after every var_update_scaler updates) from all-reduced gradients, and
  // the other steps average the gradients by a compressed all-reduce; after it the variance is
  // frozen and the ranks take local steps, synchronising the parameters by a compressed
  // all-reduce of their moves every local_step_interval steps (from 1, doubling
  // every local_step_scaler steps up to local_step_clipper): skipped communication rounds. The
  // trainer plans each kind of step (zero_one_step) and runs the schedule's.
  enum class Kind { kAdamW, kSgd, kOneBitAdam, kZeroOneAdam };
  enum class ZeroOneStep { kVariance, kCompressedGradient, kLocal, kSync };
  Kind kind = Kind::kAdamW;
  int freeze_step = 100;          // 1-bit Adam: warm-up steps before the compressed phase
  bool compressed_phase = false;  // 1-bit Adam: plan the compressed phase's step
  int var_freeze_step = 100000;   // 0/1 Adam: the last step that may update the variance
  int var_update_scaler = 16;     // 0/1 Adam: variance updates between doublings of their interval
  int local_step_scaler = 32678;  // 0/1 Adam: steps between doublings of the local-step interval
  int local_step_clipper = 16;    // 0/1 Adam: the largest local-step interval
  ZeroOneStep zero_one_step = ZeroOneStep::kVariance;  // 0/1 Adam: which step to plan
  // AdamW, 1-bit Adam and 0/1 Adam keep two moments per parameter (exp_avg, exp_avg_sq); SGD
  // none.
  bool has_moments() const { return kind != Kind::kSgd; }
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;   // on matrices only (FlatLayout::DecayRanges)
  double max_grad_norm = 1.0;  // global-norm clipping; <= 0 disables it
};

// What lives in the host tier of GPU workers between uses (on CPU workers everything already
// does, and the plan is the plain one):
//   kOptimizer   ZeRO-Offload: the fp32 master copy, Adam moments and the update; parameters on
//                the GPU.
//   kParameters  the model state too (Harmony's, ZeRO-Infinity's parameter offload): each layer's
//                parameters are copied up before its forward and again before its backward
//                (prefetch_layers ahead), freed after, its gradient copied down as soon as it is
//                complete, and the update runs on the host in place on the parameters.
enum class OffloadMode { kNone, kOptimizer, kParameters };

// ZeRO-3 parameter gathers when a rank runs several micro-batches (pipelines, accumulation).
enum class GatherPolicy : uint8_t {
  kAuto,           // once per step in a pipeline (pipeline_stages > 1), else per micro-batch
  kOncePerStep,    // each layer's parameters gathered once, shared by every micro-batch
  kPerMicroBatch,  // gathered before each micro-batch's forward and backward, freed after
};

// What one collective costs on the links between a plan's workers, latency + bytes / bandwidth:
// what the gradient buckets are sized by. Measured on a cluster before planning
// (training/collective_link.h); zero: not measured.
struct CollectiveLink {
  double latency_us = 0;
  double bytes_per_us = 0;  // 1 GB/s is 1000
  bool measured() const { return latency_us > 0 && bytes_per_us > 0; }
};

// ParallelConfig::bucket_bytes: sized from the link (ChooseGradientBuckets).
inline constexpr int64_t kAutoBucketBytes = -1;

struct ParallelConfig {
  int data_parallel = 1;  // data-parallel ranks per pipeline stage, each on its own worker(s)
  // Tensor parallelism: each data-parallel rank's layers split over this many ranks (the model
  // must be split for it: ModelSpec::SplitForTensorParallel).
  int tensor_parallel = 1;
  // Sequence parallelism (DeepSpeed-Ulysses): the data-parallel ranks of a stage in groups of
  // this many consecutive ranks, a group's ranks reading the same rows, each its 1/P of their
  // positions; around attention all-to-alls swap the sequence split for a head split (the model
  // must be split for it: ModelSpec::SplitForSequenceParallel). ZeRO and the gradients'
  // reductions run over all data_parallel ranks. 1: none.
  int sequence_parallel = 1;
  // With sequence_parallel P >= 2: how attention spans the whole sequence, DeepSpeed-Ulysses'
  // all-to-alls (the default) or ring attention's rotations of keys and values (the model must
  // be split for it: ModelSpec::SplitForSequenceParallel(P, SequenceAttention::kRing)).
  SequenceAttention sequence_attention = SequenceAttention::kUlysses;
  // Megatron-LM's sequence parallelism, with tensor_parallel T >= 2: the split model's norms,
  // residuals and other replicated layers run on 1/T of each sequence, reduce-scatters and
  // all-gathers along the sequence in place of the activations' all-reduces (the model must be
  // split for it: ModelSpec::SplitForTensorParallel(T, true)).
  bool shard_sequence = false;
  int zero_stage = 0;  // 0..3: what the ranks shard (planner/sharding_policy.h)
  OffloadMode offload = OffloadMode::kNone;
  // Under OffloadMode::kParameters on GPU workers, per layer: whether its parameters stay on the
  // device between uses (ZeRO-Offload's placement for that layer: the master copy, moments and
  // update on the host, the updated piece copied up); the others are copied up for each use.
  // Empty: none stay. The memory plan chooses it (planner/memory_plan.cc).
  std::vector<bool> resident_params;
  int micro_batches = 1;    // micro-batches per rank per step
  int prefetch_layers = 1;  // ZeRO-3: how many layers ahead parameters are gathered
  // ZeRO-3's parameter gathers and gradient reduce-scatters block-quantized to this many bits,
  // 8 or 4 (ZeRO++'s qwZ and qgZ: collectives/quantized.h; `--quantize-collectives`); 0: exact.
  int quantize_bits = 0;
  // Pipeline parallelism: pipeline_stages stages of data_parallel ranks each (num_workers() in
  // all), the layers cut into pipeline_stages x virtual_stages contiguous chunks (chunk c on
  // stage c % pipeline_stages), run in `schedule`'s order over the micro-batches
  // (planner/pipeline_schedule.h).
  int pipeline_stages = 1;
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  int virtual_stages = 1;
  // Per layer, its relative cost for balancing the stages (e.g. measured times); empty: the sum
  // of layer_op_costs, else the op cost model's estimate of its forward.
  std::vector<double> layer_costs;
  // The cut, given: per chunk (0 .. P x V - 1), how many consecutive layers it runs (`--stage-
  // layers`; the plan search's cuts). Empty: the cut that balances the layers' costs.
  std::vector<int> chunk_layers;
  // Per layer, measured times in milliseconds of its forward, backward (input half, or whole)
  // and weight half (ProfileLayerTimes, training/layer_profile.h); empty: the op cost model's
  // estimates. Their per-chunk means order zb-h1 (ScheduleOrder's costs).
  std::vector<OpCosts> layer_op_costs;
  // Measured beside them (StepProfile::TaskOverheadMs): what a step spends per task beyond the
  // tasks' own time, for predicting the step time (planner/step_time.h); 0: not measured.
  double task_overhead_ms = 0;
  // Split every backward that can be (model/model_spec.h LayerSpec::backward_input_op) even without
  // a zero-bubble pipeline: a profiling run that times the halves.
  bool split_backwards = false;
  GatherPolicy gather = GatherPolicy::kAuto;
  // Gradient buckets: the reductions of consecutive groups' gradients (in the order the backward
  // completes them, within a stage) fused into one collective until it holds at least this many
  // bytes. 0: one collective per group; kAutoBucketBytes: sized from `link`.
  int64_t bucket_bytes = kAutoBucketBytes;
  // Each reduction of one micro-batch's gradients (ZeRO-2/3's reduce-scatters) done before the
  // rank's next layer task on its worker runs (control edges: the settle_reductions pass), so a
  // rank never computes ahead of its data-parallel peers while a bucket of its waits for them:
  // its memory is the plan's predicted peak whatever their timing (else a rank ahead holds a
  // bucket the prediction has reduced: 17-27% over it on 4 workers sharing 2 cores). It gives up
  // overlapping those reductions with the next compute, which workers sharing cores do not have
  // (their collectives copy on the same cores): the plan search sets it there.
  bool settle_reductions = false;
  CollectiveLink link;
  // The worker of each rank of each stage: workers[stage * data_parallel + rank]; empty: tasks
  // unpinned.
  std::vector<WorkerId> workers;

  // Ranks per stage (T x data_parallel), and each rank's coordinates.
  int ranks_per_stage() const { return data_parallel * tensor_parallel; }
  int DataRankOf(int rank) const { return rank / tensor_parallel; }
  int TensorRankOf(int rank) const { return rank % tensor_parallel; }
  // Under sequence parallelism: a rank's place in its group (its positions), and the group (its
  // rows).
  int SequenceRankOf(int rank) const { return DataRankOf(rank) % sequence_parallel; }
  int RowGroupOf(int rank) const { return DataRankOf(rank) / sequence_parallel; }
  int num_workers() const { return ranks_per_stage() * pipeline_stages; }
  WorkerId WorkerOf(int rank, int stage) const {
    return workers.empty()
               ? WorkerId()
               : workers[static_cast<size_t>(stage) * static_cast<size_t>(ranks_per_stage()) +
                         static_cast<size_t>(rank)];
  }

  // The rows of one micro-batch of a global batch of `batch` rows (the sequence ranks of a group
  // read the same rows), and the positions of each of them a rank holds.
  int64_t MicroBatchRows(int64_t batch) const {
    return batch / (int64_t{data_parallel / sequence_parallel} * micro_batches);
  }
  int64_t RankSeqLen(int64_t seq_len) const { return seq_len / sequence_parallel; }
  // The slabs each volume splits into (spatial parallelism: kHalo), else 1.
  int slabs() const {
    return sequence_attention == SequenceAttention::kHalo ? sequence_parallel : 1;
  }
  // Whether ranks hold shards of the parameters (ZeRO-3), of the optimizer state (ZeRO >= 1);
  // the planner asks its ShardingPolicy instead, the trainer asks these.
  bool sharded_parameters() const { return zero_stage >= 3 && data_parallel > 1; }
  bool sharded_optimizer() const { return zero_stage >= 1 && data_parallel > 1; }
  std::string ToString() const;
};

// The gradient bucket size a plan uses, and why (for --explain). Auto: fusing saves a
// collective's latency, so a bucket is made big enough that the latency is about a tenth of its
// time (9 x latency x bandwidth, to the nearest power of two, so that a link measured a little
// differently plans the same buckets), and at most 25 MiB (PyTorch DDP's cap: beyond it the last
// bucket's reduction, after the whole backward, hides less). An unmeasured link is taken to be
// 50 us and 1 GB/s (a 10 GbE network).
struct BucketChoice {
  int64_t bytes = 0;
  std::string reason;
};
BucketChoice ChooseGradientBuckets(const ParallelConfig& parallel);

// Per-worker memory caps; 0: uncapped. The planner keeps each worker's predicted peak
// (planner/memory_model.h) in the tier its workers compute in (the device tier on GPU workers,
// the host tier on CPU workers) under that tier's cap, and the activations live at once in that
// tier under activation_budget times what they peak at with every activation kept (what
// torch.compile's activation_memory_budget bounds), recomputing activations where that costs
// least (planner/activation_solver.h); a plan that cannot fit is refused with figures
// (StepGraph::memory says what it chose).
struct MemoryCaps {
  int64_t device_bytes = 0;
  int64_t host_bytes = 0;
  double activation_budget = 0;  // (0, 1]; 0: none
  // Recompute every layer's activations whatever the caps (what checkpointing every layer
  // does: the naive baseline the planned choices are measured against).
  bool recompute_all = false;
  // The memory plan decides the activations only: it neither streams parameters from the host
  // nor splits the micro-batches on its own when nothing else fits, nor plans the changes that
  // would fit for a refusal's message (the plan search sets it: it enumerates those plans
  // itself, and a candidate changed on its own would be another candidate under its name).
  bool fixed_dimensions = false;
  // Device <-> host bandwidth (bytes per microsecond, each way; 1 GB/s is 1000). With it, and
  // the layers' times measured (ParallelConfig::layer_op_costs), GPU workers
  // may swap a layer's saved activations to the host and prefetch them back instead of
  // recomputing them; 0: no swapping.
  double host_link_bytes_per_us = 0;
  // Host <-> the swap file's drive on CPU workers (bytes per microsecond, each way: what
  // worker/swap_file.h copies at). With it, and the layers' times measured, CPU workers may swap
  // a layer's saved activations to the disk tier and prefetch them back; each worker then needs
  // a swap file (--swap-dir). 0: no swapping to the disk.
  double disk_link_bytes_per_us = 0;
  // The compute time a byte copied to or from the swap file takes, in microseconds (the kernel's
  // block I/O work, interrupts, a virtual machine's copies on the kernels' cores, memory
  // bandwidth: MeasureCopyCompute in training/layer_profile.h): a CPU worker's kernels lose it to
  // every swap, hidden or not, so the planner counts it in a swap's cost. 0: none.
  double disk_copy_compute_us_per_byte = 0;
};

// "none" | "optimizer" | "parameters"; InvalidArgument naming the choices otherwise.
Result<OffloadMode> ParseOffload(std::string_view text);
// "none", "optimizer", "parameters" (ParseOffload's words).
const char* OffloadModeName(OffloadMode mode);

struct TrainingPlan {
  int64_t batch = 8;  // the global batch: rows per step over all ranks and micro-batches
  int64_t seq_len = 64;
  OptimizerConfig optimizer;
  ParallelConfig parallel;
  // Where the workers compute: Device::Cpu(), or Device::Cuda(0) for each worker's own GPU.
  Device device = Device::Cpu();
  MemoryCaps memory;

  // InvalidArgument naming the field and what to change (e.g. seq_len above max_seq_len, a
  // batch that does not split over the ranks). Ranks need not be bound to workers yet
  // (PlanTrainingStep requires it when there are several).
  Status Validate(const ModelSpec& model) const;
  // Where the memory plan may swap activations to, in bytes per microsecond each way: a CPU
  // worker's swap file, a GPU worker's host link; 0: nowhere.
  double SwapLinkBytesPerUs() const {
    return device.is_cpu() ? memory.disk_link_bytes_per_us : memory.host_link_bytes_per_us;
  }
};

}  // namespace tessera
