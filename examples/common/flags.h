// The command-line flags Tessera's example drivers share (train_gpt2, train_unet3d, train_mlp),
// grouped as --help lists them, and what they mean for a training plan:
//
//   threads      --threads N
//   logging      --log-every N
//   plan         --workers N --in-process --zero-stage S --quantize-collectives none|int8|int4
//                --tensor-parallel T
//                --offload none|optimizer --grad-accum K
//                --bucket-mb auto|MB --device-memory-gib G --host-memory-gib G
//                --activation-budget F --plan flags|auto --recalibrate --calibration-rounds R
//                --show-plans N
//   device       --device cpu|cuda|cuda:N --gpu-memory-gib G
//   pipeline     --pipeline-stages P --micro-batches M --schedule gpipe|1f1b|interleaved|zb-h1
//                --virtual-stages V --gather auto|step|micro-batch --balance estimate|profile
//   checkpoints  --checkpoint-dir D --checkpoint-every S --resume
//   cluster      --address HOST:PORT --token-file F;  placement  --placement scheduler|layers
//   recovery     --max-restarts K --min-workers M --replace-workers --snapshot-every N
//                --replacement-grace-ms T
//   trace        --trace FILE --trace-steps N --explain-memory
//
// A driver declares its own flags (the model, its data, the learning rate) around the groups it
// supports (Add*Flags, each registering one group on a CLI11 app, values into CommonFlags), parses
// with ParseFlags (a usage error prints the usage and exits 2), checks the combinations with
// CheckFlagCombinations, and applies the plan flags to its TrainingPlan with ApplyPlanFlags. The
// rest of a run (where it runs, checkpoints, recovery, the loop) is examples/common/session.h and
// training_loop.h.
//
// Not thread-safe (flags are parsed and read on the driver's main thread).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/status.h"
#include "model/model_spec.h"
#include "planner/step_graph.h"
#include "worker/in_process_executor.h"

namespace tessera::examples {

struct PipelineFlags {
  int stages = 1;
  std::string schedule = "1f1b";
  int virtual_stages = 1;
  std::vector<int> stage_layers;  // the cut, per chunk (empty: balanced)
  std::string gather = "auto";
  std::string balance = "estimate";
  bool settle_reductions = false;  // ParallelConfig::settle_reductions
};

struct CheckpointFlags {
  std::string dir;  // empty: no checkpoints
  int64_t every = 0;
  bool resume = false;
};

struct RecoveryFlags {
  int max_restarts = 0;
  int min_workers = 1;
  bool replace_workers = false;
  int snapshot_every = 0;         // with --max-restarts: a peer snapshot every N steps
  int replacement_grace_ms = -1;  // -1: none on a local cluster, unless replacing; else 10 s
};

struct TraceFlags {
  std::string path;  // empty: no trace
  int steps = 2;
  bool explain_memory = false;  // print the step's predicted memory before training
};

// --plan auto: the plan search (training/auto_plan.h) chooses the parallel plan; the plan flags
// given on the command line fix their dimension of the search.
struct PlanSearchFlags {
  std::string plan = "flags";  // flags: the plan the flags say; auto: searched
  bool recalibrate = false;
  int calibration_rounds = 3;
  int show_plans = 5;
  // Which of --zero-stage, --pipeline-stages, --micro-batches (or --grad-accum), --schedule,
  // --virtual-stages, --stage-layers, --tensor-parallel and --sequence-parallel the command line
  // gave (ParseFlags records them).
  bool zero_given = false, stages_given = false, micro_given = false, schedule_given = false,
       virtual_given = false, cut_given = false, tensor_given = false, sequence_given = false;
};

struct CommonFlags {
  int threads = 0;
  int64_t log_every = 1;
  // The parallel plan and where it runs.
  int workers = 0;          // 0: this process
  bool bind_cores = false;  // --bind-cores: a local cluster's workers on cores of their own
  bool in_process = false;
  int zero_stage = 0;
  // ZeRO-3's gathers and reduce-scatters block-quantized: none, int8 or int4 (ZeRO++).
  std::string quantize_collectives = "none";
  int tensor_parallel = 1;  // T: each layer split over T workers (Megatron's tensor slicing)
  // How each sequence splits over workers: none, or ulysses (DeepSpeed-Ulysses) over groups of
  // sequence_degree data-parallel ranks (0: all of a stage's).
  std::string sequence_parallel = "none";
  int sequence_degree = 0;
  std::string offload = "none";
  std::string bucket_mb = "auto";  // gradient buckets: auto (from the measured link) or MB
  int micro_batches = 0;           // 0: not given (--grad-accum's value, else 1)
  int grad_accum = 0;              // --micro-batches' old name, a hidden alias; 0: not given
  std::string device = "cpu";      // cpu, cuda or cuda:N
  double gpu_memory_gib = 0;     // cap on the GPU allocator (0: the card's free memory less 1 GiB)
  double device_memory_gib = 0;  // the planner's per-worker caps (TrainingPlan::memory; 0: none)
  double host_memory_gib = 0;
  double activation_budget = 0;  // share of the activations' peak (0: none)
  // The GPU's host link, each way, in GB/s (MemoryCaps::host_link_bytes_per_us; 0: measured with
  // --balance profile on this process's GPU, else none: no swapping).
  double host_link_gbps = 0;
  // CPU workers' disk tier: where their swap files go (empty: TESSERA_SWAP_DIR, else none), and
  // its bandwidth each way in GB/s (MemoryCaps::disk_link_bytes_per_us; 0: measured with
  // --balance profile on this process's swap file, else no swapping).
  std::string swap_dir;
  double disk_link_gbps = 0;
  // The compute time a MiB copied to or from the swap file takes, in microseconds
  // (MemoryCaps::disk_copy_compute_us_per_byte; 0: measured with the link when that is).
  double disk_copy_compute_us_per_mib = 0;
  std::string address;  // a running cluster; empty: a local one or this process
  // Where a local cluster's session goes (the temp_dir setting; empty: TESSERA_TEMP_DIR, else
  // /tmp/tessera-<user>), and where the latest session is looked for.
  std::string temp_dir;
  std::string token_file;
  // Plugins (ops/plugin.h) ParseFlags loads, in order, before anything builds a model.
  std::vector<std::string> plugins;
  std::string placement = "scheduler";
  PipelineFlags pipeline;
  PlanSearchFlags search;
  CheckpointFlags checkpoints;
  RecoveryFlags recovery;
  TraceFlags trace;

  // Whether the steps run on a cluster (--address, or --workers N > 0).
  bool on_cluster() const { return !address.empty() || workers > 0; }
};

void AddThreadsFlag(CLI::App& app, CommonFlags& flags);
void AddLogEveryFlag(CLI::App& app, CommonFlags& flags);
// --workers, --in-process, --zero-stage, --offload, --grad-accum.
void AddPlanFlags(CLI::App& app, CommonFlags& flags);
void AddDeviceFlags(CLI::App& app, CommonFlags& flags);
void AddPipelineFlags(CLI::App& app, CommonFlags& flags);
void AddCheckpointFlags(CLI::App& app, CommonFlags& flags);
// --address (excludes --in-process when the app has it), --token-file.
void AddClusterFlags(CLI::App& app, CommonFlags& flags);
void AddRecoveryFlags(CLI::App& app, CommonFlags& flags);
void AddTraceFlags(CLI::App& app, CommonFlags& flags);
void AddPlacementFlag(CLI::App& app, CommonFlags& flags);
// --plugin PATH (repeatable): a shared library of ops and kernels (ops/plugin.h).
void AddPluginFlag(CLI::App& app, CommonFlags& flags);

// Parses the command line. Returns the exit code when the program should stop: 0 after --help
// (printed), 2 after a usage error (printed on stderr as "<program>: <error>", then the usage),
// 1 when a --plugin does not load (the reason printed). Records which plan flags were given
// (PlanSearchFlags) and loads the plugins.
std::optional<int> ParseFlags(CLI::App& app, int argc, char** argv, const char* program,
                              CommonFlags& flags);

// InvalidArgument, saying what to change, for flags that do not go together: --resume without
// --checkpoint-dir, --max-restarts without a cluster and checkpoints, --min-workers above
// --workers, --snapshot-every without --max-restarts, --replace-workers with --address.
Status CheckFlagCombinations(const CommonFlags& flags);

// Sets the plan's parallel part from the flags: data-parallel ranks (--workers, unless
// --placement layers splits one rank), ZeRO stage, offload (with a note on stderr, prefixed
// "<program>: ", when it changes nothing on CPU workers), micro-batches and the pipeline
// (--workers = P x D). InvalidArgument naming the flag when one is wrong. REQUIRES: plan.device
// is set.
Status ApplyPlanFlags(const CommonFlags& flags, const char* program, TrainingPlan& plan);

// --balance profile with a pipeline or a memory cap or budget: the plan's layer costs from a
// short profiling run (training/layer_profile.h; halves of split backwards with a pipeline),
// printed on stderr as "<program>: layer times (profiled, ms per micro-batch,
// forward/backward/weight): ...". With neither it says it has nothing to do.
Status ApplyBalance(const CommonFlags& flags, const ModelSpec& model,
                    const ExecutorOptions& executor, const char* program, TrainingPlan& plan);

// "stage 0: embedding..h.2 | stage 1: h.3..head" (chunks of one stage joined by ","), and
// the ZeRO-3 gather choice, for the run's first lines; empty without a pipeline.
std::string DescribePipeline(const StepGraph& step, const ModelSpec& model);
// "0.45 MB, 2 collectives of several groups per step: <why>"; empty over one rank.
std::string DescribeBuckets(const StepGraph& step);
// Under tensor parallelism: each layer of the split model (`planned`) on one line, how its
// parameters are split and which of its values are all-reduced over the tensor ranks; "" else.
std::string DescribeTensorParallel(const StepGraph& step, const ModelSpec& planned);
// Under sequence parallelism: the groups, and the layers whose outputs cross between a sequence
// and a head split (all-to-alls); empty otherwise.
std::string DescribeSequenceParallel(const StepGraph& step, const ModelSpec& planned);

}  // namespace tessera::examples
