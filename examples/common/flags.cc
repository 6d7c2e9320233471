#include "examples/common/flags.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/flag_checks.h"
#include "core/version.h"
#include "ops/plugin.h"
#include "training/layer_profile.h"

namespace tessera::examples {

void AddThreadsFlag(CLI::App& app, CommonFlags& flags) {
  app.add_option("--threads", flags.threads, "CPU threads (0: one per core)")
      ->check(tessera::AtLeast(0));
}

void AddLogEveryFlag(CLI::App& app, CommonFlags& flags) {
  app.add_option("--log-every", flags.log_every, "Print every N-th step line")
      ->check(tessera::AtLeast(1));
}

void AddPlanFlags(CLI::App& app, CommonFlags& flags) {
  CLI::Option* workers =
      app.add_option("--workers", flags.workers,
                     "N data-parallel workers: a local cluster of N CPU worker processes, or N "
                     "workers of --address (0: in this process; with --address, every worker "
                     "there that the batch splits across)")
          ->check(tessera::AtLeast(0));
  app.add_flag("--bind-cores", flags.bind_cores,
               "With --workers: bind each local worker to cores of its own (worker i the "
               "--threads CPUs from the i * threads-th; more workers than cores share them "
               "evenly), as DeepSpeed's --bind_cores_to_rank; the default lets the system move "
               "them")
      ->needs(workers);
  app.add_flag("--in-process", flags.in_process,
               "Train in this process: no scheduler or worker processes (the default when "
               "neither --workers nor --address is given)")
      ->excludes(workers);
  app.add_option("--zero-stage", flags.zero_stage,
                 "With --workers: 0 data parallel, 1 shard optimizer state, 2 + gradients, "
                 "3 + parameters");
  app.add_option("--quantize-collectives", flags.quantize_collectives,
                 "With --zero-stage 3: its parameter gathers and gradient reduce-scatters sent "
                 "block-quantized, int8 (1/2 of bf16's bytes) or int4 (1/4): ZeRO++'s qwZ and qgZ")
      ->check(CLI::IsMember({"none", "int8", "int4"}));
  app.add_option("--tensor-parallel", flags.tensor_parallel,
                 "T: each layer split over T workers (Megatron-LM's tensor slicing: attention "
                 "heads and MLP columns, two all-reduces forward and two backward per block); "
                 "--workers is then D x T x P")
      ->check(tessera::AtLeast(1));
  app.add_option("--sequence-parallel", flags.sequence_parallel,
                 "none, or ulysses: each sequence split over groups of data-parallel workers "
                 "(DeepSpeed-Ulysses: every worker of a group reads the same rows, each 1/P of "
                 "their positions; all-to-alls swap the sequence split for a head split around "
                 "attention; head counts P does not divide run padded), or megatron: with "
                 "--tensor-parallel T, the norms and residuals on 1/T of each sequence "
                 "(Megatron-LM's sequence parallelism: reduce-scatters and all-gathers in place "
                 "of the all-reduces), or ring: groups as ulysses, every head on every worker, "
                 "keys and values rotated round the group (P - 1 rotations a block) and the "
                 "partial attentions merged by their log-sum-exp (GPT-2 with --layer-impl "
                 "primitive)")
      ->check(CLI::IsMember({"none", "ulysses", "megatron", "ring"}));
  app.add_option("--sequence-degree", flags.sequence_degree,
                 "P: the data-parallel workers a sequence splits over under --sequence-parallel "
                 "(0: all of a stage's)")
      ->check(tessera::AtLeast(0));
  app.add_option("--offload", flags.offload,
                 "none; optimizer: master weights, Adam state and the update in the host "
                 "tier and on the CPU (ZeRO-Offload); parameters: the parameters too, each "
                 "layer's copied to the GPU before its forward and backward and its gradient "
                 "copied back (for model states beyond the GPU's memory; a device cap chooses "
                 "it when nothing else fits). On CPU workers nothing moves");
  app.add_option("--bucket-mb", flags.bucket_mb,
                 "With --workers: reduce consecutive layers' gradients in one collective until "
                 "it holds this many MB (0: one collective per layer); auto sizes them from the "
                 "collectives' latency and bandwidth, measured on the workers");
  app.add_option("--micro-batches", flags.micro_batches,
                 "M micro-batches per worker per step: gradient accumulation, and what flows "
                 "through a pipeline (formerly --grad-accum, still accepted)")
      ->check(tessera::AtLeast(0));
  // Old command lines keep working; the help lists only --micro-batches.
  app.add_option("--grad-accum", flags.grad_accum)->check(tessera::AtLeast(1))->group("");
  app.add_option("--device-memory-gib", flags.device_memory_gib,
                 "Per worker, the GPU memory a step may use (GPU workers): the planner predicts "
                 "the step's peak and recomputes activations where that costs least to fit it, "
                 "or refuses the plan with figures (0: uncapped)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--plan", flags.search.plan,
                 "flags: the plan the flags say; auto: the system chooses data parallelism, "
                 "tensor parallelism (with or without Megatron's sequence sharding, where the "
                 "model splits), pipeline stages and schedule, micro-batches and the ZeRO stage "
                 "(any of those flags given fixes its part) by simulating every plan that fits the "
                 "memory caps "
                 "on costs measured on this cluster (cached between runs; --recalibrate measures "
                 "again), and says which it chose and why")
      ->check(CLI::IsMember({"flags", "auto"}));
  app.add_flag("--recalibrate", flags.search.recalibrate,
               "With --plan auto: measure the layer times and links again instead of using the "
               "cached ones");
  app.add_option("--calibration-rounds", flags.search.calibration_rounds,
                 "With --plan auto: rounds of every calibration measurement (a figure is the "
                 "median of its rounds')")
      ->check(tessera::AtLeast(1));
  app.add_option("--show-plans", flags.search.show_plans,
                 "With --plan auto: how many of the best plans to list")
      ->check(tessera::AtLeast(1));
  app.add_option("--host-memory-gib", flags.host_memory_gib,
                 "Per worker, the host memory a step may use (on CPU workers the tier they "
                 "compute in, planned as --device-memory-gib is on GPUs; 0: uncapped)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--activation-budget", flags.activation_budget,
                 "The share of its activations a step may hold at once, of what it holds "
                 "keeping every one (as torch.compile's activation_memory_budget): the planner "
                 "recomputes the layers that cost least to fit it (0: no budget)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--host-link-gbps", flags.host_link_gbps,
                 "On GPUs under a memory cap: the bandwidth between a GPU and its host, each "
                 "way, in GB/s, with which the planner may swap activations to the host instead "
                 "of recomputing them (0: measured with --balance profile on this process's "
                 "GPU; else no swapping)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--swap-dir", flags.swap_dir,
                 "On CPU workers: a directory (on a local NVMe drive, ideally) for each "
                 "worker's swap file, the disk tier to which the planner may swap activations "
                 "the host cap cannot hold, and prefetch them back, instead of recomputing them "
                 "(TESSERA_SWAP_DIR; empty: no disk tier)");
  app.add_option("--disk-link-gbps", flags.disk_link_gbps,
                 "With --swap-dir: the swap file's bandwidth, each way, in GB/s (0: measured "
                 "with --balance profile on this process's swap file)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--disk-copy-compute-us-per-mib", flags.disk_copy_compute_us_per_mib,
                 "With --swap-dir: the compute time a MiB copied to or from the swap file takes, "
                 "in microseconds (the kernel's I/O work, interrupts, a virtual machine's copies "
                 "on the same cores), which the planner adds to every swap's cost (0: measured "
                 "with the link by --balance profile: the step profiled beside copies; else "
                 "none)")
      ->check(CLI::NonNegativeNumber);
}

void AddDeviceFlags(CLI::App& app, CommonFlags& flags) {
  app.add_option("--device", flags.device,
                 "cpu, or cuda / cuda:N: train on a GPU (bf16 activations, fp32 master "
                 "weights and AdamW state): this process's, or with --workers N each worker's "
                 "(a local cluster of N GPU workers on GPU N, or on every GPU in turn)");
  app.add_option("--gpu-memory-gib", flags.gpu_memory_gib,
                 "With --device cuda: cap on the GPU memory the allocator hands out (0: the "
                 "card's free memory less 1 GiB)")
      ->check(tessera::AtLeast(0));
}

void AddPipelineFlags(CLI::App& app, CommonFlags& flags) {
  PipelineFlags& p = flags.pipeline;
  app.add_option("--pipeline-stages", p.stages,
                 "P pipeline stages: the layers cut into P parts, each on a group of "
                 "--workers / P data-parallel workers")
      ->check(tessera::AtLeast(1));
  app.add_option("--schedule", p.schedule, "Pipeline schedule: gpipe, 1f1b, interleaved or zb-h1");
  app.add_option("--virtual-stages", p.virtual_stages,
                 "V model chunks per stage (--schedule interleaved)")
      ->check(tessera::AtLeast(1));
  app.add_option("--stage-layers", p.stage_layers,
                 "The cut: how many consecutive layers each pipeline chunk runs, in order "
                 "(P numbers, P x V with --virtual-stages; default: the cut that balances the "
                 "layers' costs)")
      ->delimiter(',')
      ->check(tessera::AtLeast(1));
  app.add_option("--gather", p.gather,
                 "ZeRO-3 with several micro-batches: gather each layer's parameters once per step "
                 "(step), before every use (micro-batch), or let the planner choose (auto)");
  app.add_flag("--settle-reductions", p.settle_reductions,
               "ZeRO-2/3 with several micro-batches: each micro-batch's gradient reductions done "
               "before the worker's next layer task, so a worker ahead of its data-parallel peers "
               "holds no bucket beyond the predicted peak (--plan auto sets it where workers "
               "share cores)");
  app.add_option("--balance", p.balance,
                 "How stages are balanced and the memory plan prices recomputing: by the op "
                 "cost model's estimate of each layer (estimate), or by each layer's time in a "
                 "short profiling run in this process (profile)")
      ->check(CLI::IsMember({"estimate", "profile"}));
}

void AddCheckpointFlags(CLI::App& app, CommonFlags& flags) {
  CheckpointFlags& c = flags.checkpoints;
  app.add_option("--checkpoint-dir", c.dir,
                 "Save checkpoints here (at the end, and every --checkpoint-every steps)");
  app.add_option("--checkpoint-every", c.every, "Steps between checkpoints (0: end)")
      ->check(tessera::AtLeast(0));
  app.add_flag("--resume", c.resume,
               "Continue from the latest checkpoint in --checkpoint-dir (any --workers and "
               "--zero-stage)");
}

void AddClusterFlags(CLI::App& app, CommonFlags& flags) {
  CLI::Option* address =
      app.add_option("--address", flags.address, "Run on the cluster at HOST:PORT");
  if (CLI::Option* in_process = app.get_option_no_throw("--in-process")) {
    address->excludes(in_process);
  }
  app.add_option("--token-file", flags.token_file,
                 "With --address: the cluster token (default: the latest session's)");
  app.add_option("--temp-dir", flags.temp_dir,
                 "Where a local cluster's session (token, logs, spill) goes and the latest "
                 "session is looked for (TESSERA_TEMP_DIR; default /tmp/tessera-<user>)");
}

void AddRecoveryFlags(CLI::App& app, CommonFlags& flags) {
  RecoveryFlags& r = flags.recovery;
  app.add_option("--max-restarts", r.max_restarts,
                 "Recover from lost workers (and, with --address, a restarted scheduler) up to K "
                 "times: re-plan on the workers there are and resume from the last checkpoint "
                 "(needs --workers and --checkpoint-dir)")
      ->check(tessera::AtLeast(0));
  app.add_option("--min-workers", r.min_workers,
                 "With --max-restarts: give up when fewer workers than this remain")
      ->check(tessera::AtLeast(1));
  app.add_flag("--replace-workers", r.replace_workers,
               "With --max-restarts on a local cluster: start a worker for each one lost");
  app.add_option("--snapshot-every", r.snapshot_every,
                 "With --max-restarts: every N steps (and at every checkpoint) keep the state in "
                 "memory on the workers, each piece also on the next rank's worker, and recover "
                 "from it instead of the disk checkpoint when it survives (0: off)")
      ->check(tessera::AtLeast(0));
  app.add_option("--replacement-grace-ms", r.replacement_grace_ms,
                 "With --max-restarts: how long to wait for the cluster to be back at --workers "
                 "before going on with fewer (default: 0 on a local cluster, 30000 with "
                 "--replace-workers, 10000 with --address)")
      ->check(tessera::Between(-1, 3'600'000));
}

void AddTraceFlags(CLI::App& app, CommonFlags& flags) {
  app.add_option("--trace", flags.trace.path,
                 "At the end, write the last --trace-steps training steps' trace (tasks, "
                 "collectives, transfers on every worker) to this file as Chrome/Perfetto JSON "
                 "(open in ui.perfetto.dev)");
  app.add_option("--trace-steps", flags.trace.steps, "How many of the last steps --trace writes")
      ->check(tessera::AtLeast(1));
  app.add_flag("--explain-memory", flags.trace.explain_memory,
               "Before training, print the memory one step needs on each worker, predicted from "
               "its graph: the peak per tier, the task it is reached at, what is live then, and "
               "a timeline (with --steps 0: only that). After training, each rank's line gives "
               "the measured peak (all objects, and with the running kernels' scratch: the "
               "predicted figure) "
               "beside it");
}

void AddPlacementFlag(CLI::App& app, CommonFlags& flags) {
  app.add_option("--placement", flags.placement,
                 "On a cluster: scheduler (tasks follow their inputs) or layers (layer by layer "
                 "round-robin over the workers)")
      ->check(CLI::IsMember({"scheduler", "layers"}));
}

void AddPluginFlag(CLI::App& app, CommonFlags& flags) {
  app.add_option("--plugin", flags.plugins,
                 "Load this plugin (a shared library of ops and kernels built with the SDK's "
                 "tessera_add_plugin) before building the model; the cluster's workers get it "
                 "from the driver. Repeatable")
      ->type_name("PATH");
}

std::optional<int> ParseFlags(CLI::App& app, int argc, char** argv, const char* program,
                              CommonFlags& flags) {
  std::optional<int> exit = ParseCommandLine(app, argc, argv, program, VersionLine(program));
  if (exit) return exit;
  for (const std::string& path : flags.plugins) {
    Result<const LoadedPlugin*> plugin = LoadPlugin(path);
    if (!plugin.ok()) {
      std::fprintf(stderr, "%s: --plugin %s: %s\n", program, path.c_str(),
                   plugin.status().ToString().c_str());
      return 1;
    }
    std::fprintf(stderr, "%s: loaded plugin '%s' from %s\n", program, (*plugin)->name.c_str(),
                 (*plugin)->path.c_str());
  }
  const auto given = [&app](const char* name) {
    const CLI::Option* option = app.get_option_no_throw(name);
    return option != nullptr && option->count() > 0;
  };
  PlanSearchFlags& search = flags.search;
  search.zero_given = given("--zero-stage");
  search.stages_given = given("--pipeline-stages");
  search.micro_given = given("--micro-batches") || given("--grad-accum");
  search.schedule_given = given("--schedule");
  search.virtual_given = given("--virtual-stages");
  search.cut_given = given("--stage-layers");
  search.tensor_given = given("--tensor-parallel");
  search.sequence_given = given("--sequence-parallel");
  return exit;
}

Status CheckFlagCombinations(const CommonFlags& flags) {
  if (flags.checkpoints.resume && flags.checkpoints.dir.empty()) {
    return InvalidArgument("--resume needs --checkpoint-dir (where to resume from)");
  }
  const RecoveryFlags& r = flags.recovery;
  if (r.max_restarts > 0 && (flags.checkpoints.dir.empty() || flags.workers == 0)) {
    return InvalidArgument(
        "--max-restarts recovers a run on a cluster from its checkpoints: it needs --workers "
        "(with --address or a local cluster) and --checkpoint-dir");
  }
  if (flags.workers > 0 && r.min_workers > flags.workers) {
    return InvalidArgument(
        "--min-workers {} is more than --workers {}: the run could never have that many; use "
        "--min-workers {} or fewer",
        r.min_workers, flags.workers, flags.workers);
  }
  if (r.snapshot_every > 0 && r.max_restarts == 0) {
    return InvalidArgument(
        "--snapshot-every keeps state for recovery: it needs --max-restarts K (K >= 1)");
  }
  if (flags.sequence_parallel == "megatron" && flags.tensor_parallel < 2) {
    return InvalidArgument(
        "--sequence-parallel megatron shards each sequence over the tensor-parallel workers: add "
        "--tensor-parallel T (T >= 2), or use --sequence-parallel ulysses");
  }
  if (flags.sequence_parallel == "megatron" && flags.sequence_degree > 0) {
    return InvalidArgument(
        "--sequence-parallel megatron splits each sequence over the --tensor-parallel workers: "
        "drop --sequence-degree {} (it sizes ulysses' groups)",
        flags.sequence_degree);
  }
  if ((flags.sequence_parallel == "ulysses" || flags.sequence_parallel == "ring") &&
      flags.search.plan == "auto") {
    return InvalidArgument(
        "--plan auto searches tensor parallelism and Megatron-LM's sequence sharding, not "
        "--sequence-parallel {} yet: give the plan's flags without --plan auto, or --plan auto "
        "without it",
        flags.sequence_parallel);
  }
  if (flags.sequence_degree > 0 && flags.sequence_parallel == "none") {
    return InvalidArgument(
        "--sequence-degree {} splits sequences: add --sequence-parallel ulysses or ring, or "
        "drop it",
        flags.sequence_degree);
  }
  if (r.replace_workers && !flags.address.empty()) {
    return InvalidArgument(
        "--replace-workers starts workers of a local cluster; on a running cluster start them "
        "with `tessera start --cpu-workers N` (recovery waits --replacement-grace-ms for them)");
  }
  return Status::Ok();
}

namespace {

// --sequence-parallel ulysses or ring over --sequence-degree of the data-parallel ranks (0: all).
Status ApplySequenceParallel(const CommonFlags& flags, ParallelConfig& p) {
  if (flags.sequence_parallel == "none") return Status::Ok();
  if (flags.sequence_parallel == "megatron") {
    p.shard_sequence = true;  // over the tensor ranks (CheckFlagCombinations: T >= 2)
    return Status::Ok();
  }
  const int degree = flags.sequence_degree > 0 ? flags.sequence_degree : p.data_parallel;
  if (degree < 2 || p.data_parallel % degree != 0) {
    return InvalidArgument(
        "--sequence-parallel {} splits each sequence over {} of the {} data-parallel worker(s) "
        "per stage: it needs --sequence-degree a divisor of them, at least 2 (and --workers "
        "D x T x P with D >= 2)",
        flags.sequence_parallel, degree, p.data_parallel);
  }
  p.sequence_parallel = degree;
  p.sequence_attention =
      flags.sequence_parallel == "ring" ? SequenceAttention::kRing : SequenceAttention::kUlysses;
  return Status::Ok();
}

Status ApplyPipeline(const CommonFlags& flags, TrainingPlan& plan) {
  const PipelineFlags& pipeline = flags.pipeline;
  ParallelConfig& p = plan.parallel;
  TESSERA_ASSIGN_OR_RETURN(p.schedule, ParseSchedule(pipeline.schedule));
  if (pipeline.gather == "auto") {
    p.gather = GatherPolicy::kAuto;
  } else if (pipeline.gather == "step") {
    p.gather = GatherPolicy::kOncePerStep;
  } else if (pipeline.gather == "micro-batch") {
    p.gather = GatherPolicy::kPerMicroBatch;
  } else {
    return InvalidArgument("--gather '{}' is not one of: auto, step, micro-batch", pipeline.gather);
  }
  p.pipeline_stages = pipeline.stages;
  p.virtual_stages = pipeline.virtual_stages;
  p.settle_reductions = pipeline.settle_reductions;
  p.chunk_layers = pipeline.stage_layers;
  p.tensor_parallel = flags.tensor_parallel;
  const int per_rank = pipeline.stages * flags.tensor_parallel;  // workers a data rank takes
  if (per_rank == 1) return ApplySequenceParallel(flags, p);
  if (flags.workers < per_rank || flags.workers % per_rank != 0) {
    const std::string dims =
        flags.tensor_parallel == 1 ? fmt::format("--pipeline-stages {}", pipeline.stages)
        : pipeline.stages == 1     ? fmt::format("--tensor-parallel {}", flags.tensor_parallel)
                                   : fmt::format("--pipeline-stages {} x --tensor-parallel {}",
                                                 pipeline.stages, flags.tensor_parallel);
    return InvalidArgument(
        "{} needs --workers a multiple of {} (D x T x P workers: D data-parallel ranks), got "
        "--workers {}",
        dims, per_rank, flags.workers);
  }
  p.data_parallel = flags.workers / per_rank;
  return ApplySequenceParallel(flags, p);
}

}  // namespace

Status ApplyPlanFlags(const CommonFlags& flags, const char* program, TrainingPlan& plan) {
  plan.parallel.zero_stage = flags.zero_stage;
  plan.parallel.quantize_bits = flags.quantize_collectives == "int8"   ? 8
                                : flags.quantize_collectives == "int4" ? 4
                                                                       : 0;
  if (flags.micro_batches > 0 && flags.grad_accum > 1 && flags.micro_batches != flags.grad_accum) {
    return InvalidArgument(
        "--micro-batches {} and --grad-accum {} both set the micro-batches per step: give one",
        flags.micro_batches, flags.grad_accum);
  }
  plan.parallel.micro_batches = flags.micro_batches > 0 ? flags.micro_batches
                                : flags.grad_accum > 0  ? flags.grad_accum
                                                        : 1;
  TESSERA_ASSIGN_OR_RETURN(plan.parallel.offload, ParseOffload(flags.offload));
  if (flags.bucket_mb != "auto") {
    double mb = -1;
    try {
      size_t used = 0;
      mb = std::stod(flags.bucket_mb, &used);
      if (used != flags.bucket_mb.size()) mb = -1;
    } catch (const std::exception&) {
      mb = -1;
    }
    if (!(mb >= 0 && mb <= 1e6)) {
      return InvalidArgument(
          "--bucket-mb '{}' is neither auto nor a size in MB from 0 (one collective per layer) "
          "to 1000000",
          flags.bucket_mb);
    }
    plan.parallel.bucket_bytes = static_cast<int64_t>(mb * 1e6);
  }
  if (plan.parallel.offload != OffloadMode::kNone && plan.device.is_cpu()) {
    std::fprintf(stderr,
                 "%s: --offload %s: CPU workers already keep the model state and update it in "
                 "host memory, so the plan is the same as without it\n",
                 program, OffloadModeName(plan.parallel.offload));
  }
  plan.memory.device_bytes = static_cast<int64_t>(flags.device_memory_gib * (1 << 30));
  plan.memory.host_bytes = static_cast<int64_t>(flags.host_memory_gib * (1 << 30));
  plan.memory.activation_budget = flags.activation_budget;
  plan.memory.host_link_bytes_per_us = flags.host_link_gbps * 1e3;  // 1 GB/s = 1e3 bytes/us
  plan.memory.disk_link_bytes_per_us = flags.disk_link_gbps * 1e3;
  plan.memory.disk_copy_compute_us_per_byte = flags.disk_copy_compute_us_per_mib / (1 << 20);
  // --workers N: N data-parallel ranks, one per worker (layer placement splits one rank).
  if (flags.workers > 0 && flags.placement != "layers") plan.parallel.data_parallel = flags.workers;
  return ApplyPipeline(flags, plan);
}

Status ApplyBalance(const CommonFlags& flags, const ModelSpec& model,
                    const ExecutorOptions& executor, const char* program, TrainingPlan& plan) {
  if (flags.pipeline.balance != "profile") return Status::Ok();
  const bool pipeline = plan.parallel.pipeline_stages * plan.parallel.virtual_stages > 1;
  const bool capped = plan.memory.device_bytes > 0 || plan.memory.host_bytes > 0 ||
                      plan.memory.activation_budget > 0;
  if (!pipeline && !capped) {
    std::fprintf(stderr,
                 "%s: --balance profile times the layers for balancing pipeline stages and for "
                 "the memory plan; with neither --pipeline-stages nor a memory cap or "
                 "--activation-budget there is nothing to use them, so no profiling run\n",
                 program);
    return Status::Ok();
  }
  // Pipelines time the halves of split backwards (zb-h1 orders by them); the memory plan prices
  // recomputes and rebuilds by whole layers.
  LayerProfileOptions options;
  options.split_backwards = pipeline;
  TESSERA_ASSIGN_OR_RETURN(StepProfile profile, ProfileStep(model, plan, executor, options));
  std::vector<OpCosts>& ms = profile.layer_ms;
  std::string text;
  for (size_t l = 0; l < model.layers.size(); ++l) {
    text += fmt::format("{}{} {:.2f}/{:.2f}/{:.2f}", l == 0 ? "" : ", ", model.layers[l].name,
                        ms[l].forward, ms[l].backward, ms[l].weight);
    // A layer too fast to time still costs something.
    ms[l].forward = std::max(ms[l].forward, 1e-3);
    ms[l].backward = std::max(ms[l].backward, 1e-3);
  }
  std::fprintf(stderr,
               "%s: layer times (profiled, ms per micro-batch, forward/backward/weight): %s\n",
               program, text.c_str());
  plan.parallel.layer_op_costs = std::move(ms);
  plan.parallel.task_overhead_ms = profile.TaskOverheadMs();
  // Under a cap on this process's GPU, the host link too: what the planner times swaps by.
  if (capped && executor.device != nullptr && plan.memory.host_link_bytes_per_us == 0) {
    TESSERA_ASSIGN_OR_RETURN(plan.memory.host_link_bytes_per_us, MeasureHostLink(*executor.device));
    std::fprintf(stderr, "%s: host link (measured, %s): %.2f GB/s each way\n", program,
                 executor.device->device().ToString().c_str(),
                 plan.memory.host_link_bytes_per_us / 1e3);
  }
  // On CPU workers with a swap file, the disk's (this process's file stands for the workers').
  if (capped && plan.device.is_cpu() && executor.disk != nullptr &&
      plan.memory.disk_link_bytes_per_us == 0) {
    TESSERA_ASSIGN_OR_RETURN(plan.memory.disk_link_bytes_per_us, MeasureHostLink(*executor.disk));
    if (plan.memory.disk_copy_compute_us_per_byte == 0) {
      TESSERA_ASSIGN_OR_RETURN(
          plan.memory.disk_copy_compute_us_per_byte,
          MeasureCopyCompute(model, plan, executor, *executor.disk, profile, options));
    }
    std::fprintf(stderr,
                 "%s: disk link (measured, %s): %.2f GB/s each way; a MiB copied takes %.1f us "
                 "of the compute\n",
                 program, executor.disk->Describe().c_str(),
                 plan.memory.disk_link_bytes_per_us / 1e3,
                 plan.memory.disk_copy_compute_us_per_byte * (1 << 20));
  }
  return Status::Ok();
}

std::string DescribeBuckets(const StepGraph& step) {
  if (step.buckets.reason.empty()) return "";
  return fmt::format("{:.2f} MB, {} collective(s) of several layers per step: {}",
                     static_cast<double>(step.buckets.bytes) / 1e6, step.fused_reductions,
                     step.buckets.reason);
}

std::string DescribeTensorParallel(const StepGraph& step, const ModelSpec& planned) {
  const int ranks = step.parallel.tensor_parallel;
  if (ranks == 1) return "";
  std::string text = fmt::format("each layer over {} tensor ranks:", ranks);
  for (const LayerSpec& layer : planned.layers) {
    if (!layer.tensor_parallel) continue;
    const TensorParallelLayer& tp = *layer.tensor_parallel;
    std::vector<std::string> parts;
    const auto& slots = layer.params.slots();
    std::vector<std::string> replicated;
    for (size_t s = 0; s < slots.size(); ++s) {
      const SlotSplit& split = tp.slots[s];
      if (split.replicated()) {
        replicated.push_back(slots[s].name);
      } else {
        parts.push_back(
            fmt::format("{} {} split{}", slots[s].name,
                        split.dim == 0   ? std::string("rows")
                        : split.dim == 1 ? std::string("columns")
                                         : fmt::format("dim {}", split.dim),
                        split.blocks > 1 ? fmt::format(" in {} blocks", split.blocks) : ""));
      }
    }
    if (!replicated.empty())
      parts.push_back(fmt::format("{} replicated", fmt::join(replicated, ", ")));
    if (tp.sequence_sharded) {
      parts.push_back(
          fmt::format("on 1/{} of the positions, parameter gradients all-reduced", ranks));
    }
    for (size_t o = 0; o < tp.partial_outputs.size(); ++o) {
      if (tp.scatters(o)) {
        parts.push_back(fmt::format("output {} reduce-scattered along the sequence", o));
      } else if (tp.partial_outputs[o]) {
        parts.push_back(fmt::format("output {} all-reduced", o));
      } else if (tp.gathers(o)) {
        parts.push_back(fmt::format("output {} all-gathered along the sequence", o));
      }
    }
    for (size_t a = 0; a < tp.partial_input_gradients.size(); ++a) {
      if (!tp.partial_input_gradients[a]) continue;
      // The gradient of a gathered value is summed by the gather's adjoint.
      parts.push_back(fmt::format(
          "gradient of input {} {}", a,
          planned.ReadsGathered(layer, a) ? "reduce-scattered along the sequence" : "all-reduced"));
    }
    text += fmt::format("\n  {}: {}", layer.name,
                        parts.empty() ? std::string("no parameters, replicated")
                                      : fmt::format("{}", fmt::join(parts, "; ")));
  }
  return text;
}

std::string DescribeSequenceParallel(const StepGraph& step, const ModelSpec& planned) {
  const ParallelConfig& p = step.parallel;
  if (p.sequence_parallel == 1) return "";
  if (p.sequence_attention == SequenceAttention::kHalo) {
    int halos = 0, statistics = 0;
    for (const LayerSpec& layer : planned.layers) {
      for (const ExchangeLayout layout : layer.exchanged_outputs) {
        halos += PassesHalo(layout) ? 1 : 0;
        statistics += layout == ExchangeLayout::kBlocks ? 1 : 0;
      }
    }
    return fmt::format(
        "each volume in {} slabs of its depth ({} group(s) of the {} data-parallel ranks, each "
        "rank one slab of every volume); per forward, {} boundary planes passed to a neighbour "
        "(halos for the convolutions) and {} norms' statistics exchanged by all-to-alls",
        p.sequence_parallel, p.data_parallel / p.sequence_parallel, p.data_parallel, halos,
        statistics);
  }
  std::vector<std::string> exchanged;
  for (const LayerSpec& layer : planned.layers) {
    for (size_t o = 0; o < layer.exchanged_outputs.size(); ++o) {
      if (layer.exchanges(o)) {
        exchanged.push_back(fmt::format("{} output {} ({})", layer.name, o,
                                        ExchangeLayoutName(layer.exchanged_outputs[o])));
      }
    }
  }
  const bool ring = p.sequence_attention == SequenceAttention::kRing;
  return fmt::format(
      "each sequence over {} ranks ({}; {} group(s) of the {} data-parallel ranks, each rank {} "
      "of every row's positions); {} after {}",
      p.sequence_parallel, ring ? "ring attention" : "DeepSpeed-Ulysses",
      p.data_parallel / p.sequence_parallel, p.data_parallel,
      p.sequence_parallel == 2 ? std::string("half") : fmt::format("1/{}", p.sequence_parallel),
      ring ? "keys and values rotated to the next rank" : "all-to-alls",
      fmt::join(exchanged, ", "));
}

std::string DescribePipeline(const StepGraph& step, const ModelSpec& model) {
  const ParallelConfig& p = step.parallel;
  if (p.pipeline_stages == 1 && p.virtual_stages == 1) return "";
  std::string text;
  for (int stage = 0; stage < p.pipeline_stages; ++stage) {
    text += fmt::format("{}stage {}:", stage == 0 ? "" : " | ", stage);
    for (int chunk = stage; chunk < p.pipeline_stages * p.virtual_stages;
         chunk += p.pipeline_stages) {
      std::string first, last;
      for (size_t l = 0; l < model.layers.size(); ++l) {
        if (step.layer_chunk[l] != chunk) continue;
        if (first.empty()) first = model.layers[l].name;
        last = model.layers[l].name;
      }
      text += fmt::format("{} {}{}", chunk == stage ? "" : ",", first,
                          first == last ? "" : ".." + last);
    }
  }
  if (!step.gather_reason.empty()) {
    text += fmt::format("\nZeRO-3 gathers {}: {}",
                        step.gather_once_per_step ? "once per step" : "per micro-batch",
                        step.gather_reason);
  }
  return text;
}

}  // namespace tessera::examples
