#include "launcher/plan_command.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "core/device.h"
#include "core/flag_checks.h"
#include "core/settings.h"
#include "launcher/described_cluster.h"
#include "model/gpt2.h"
#include "model/unet3d.h"
#include "ops/standard_ops.h"
#include "planner/scale_search.h"
#include "training/auto_plan.h"
#include "worker/gpu.h"

namespace tessera {
namespace {

int64_t SeqLen(const PlanCommandFlags& flags) { return flags.seq_len > 0 ? flags.seq_len : 64; }

Result<ModelSpec> BuildModel(const PlanCommandFlags& flags, bool gpu) {
  if (flags.model == "gpt2") {
    TESSERA_ASSIGN_OR_RETURN(Gpt2Config config, Gpt2Config::Preset(flags.preset));
    if (flags.layers > 0) config.layers = flags.layers;
    if (flags.channels > 0) config.channels = flags.channels;
    if (flags.heads > 0) config.heads = flags.heads;
    if (flags.vocab > 0) config.vocab = flags.vocab;
    config.max_seq_len = std::max(config.max_seq_len, SeqLen(flags));
    if (gpu) config.activations = GpuActivations();
    TESSERA_RETURN_IF_ERROR(config.Validate().WithContext("--model gpt2"));
    return BuildGpt2(config);
  }
  if (flags.model == "unet3d") {
    TESSERA_ASSIGN_OR_RETURN(UNet3dConfig config, UNet3dConfig::Preset(flags.preset));
    OpRegistry registry;
    TESSERA_RETURN_IF_ERROR(RegisterStandardOps(registry));
    return BuildUNet3d(config, registry);
  }
  return InvalidArgument("--model '{}' is not one of: gpt2, unet3d", flags.model);
}

constexpr const char* kScaleModels = "gpt3-175b, megatron-76b, llama2-70b, gpt2-1.5b";

// --cluster: the search at scale on a described cluster.
Status PlanAtScale(const PlanCommandFlags& flags) {
  if (flags.model == "gpt2" || flags.model == "unet3d") {
    return InvalidArgument(
        "--cluster plans a transformer by its shape: --model must be one of: {} (gpt2 and unet3d "
        "are planned on a real cluster, without --cluster)",
        kScaleModels);
  }
  TESSERA_ASSIGN_OR_RETURN(DescribedCluster cluster, launcher::ReadDescribedCluster(flags.cluster));
  TESSERA_ASSIGN_OR_RETURN(TransformerShape shape, TransformerShape::Preset(flags.model));
  // The preset's shape, changed where the flags say (a model of one's own, by its shape).
  if (flags.layers > 0) shape.layers = flags.layers;
  if (flags.channels > 0) shape.hidden = flags.channels;
  if (flags.heads > 0) shape.heads = flags.heads;
  if (flags.vocab > 0) shape.vocab = flags.vocab;
  if (flags.seq_len > 0) shape.seq_len = flags.seq_len;
  const bool changed = flags.layers > 0 || flags.channels > 0 || flags.heads > 0 ||
                       flags.vocab > 0 || flags.seq_len > 0;
  if (changed) shape.name += " (changed)";
  TESSERA_RETURN_IF_ERROR(shape.Validate().WithContext("--layers/--channels/--heads"));
  ScaleTraining training;
  training.global_batch = flags.batch > 0 ? flags.batch : shape.published_batch;
  training.overlap_communication = !flags.no_overlap;
  ScaleSpace space;
  space.gpus = flags.gpus;
  if (!flags.tensor_parallel.empty()) space.tensor_parallel = flags.tensor_parallel;
  if (flags.sequence_parallel == "none") space.shard_sequence = {false};
  if (flags.sequence_parallel == "megatron") space.shard_sequence = {true};
  std::printf("%s (%.1fB parameters), global batch %lld x %lld tokens on %s (%d nodes x %d %s)\n",
              shape.name.c_str(), static_cast<double>(shape.Parameters()) / 1e9,
              static_cast<long long>(training.global_batch), static_cast<long long>(shape.seq_len),
              cluster.name.c_str(), cluster.nodes, cluster.gpus_per_node,
              cluster.gpu.empty() ? "GPUs" : cluster.gpu.c_str());
  TESSERA_ASSIGN_OR_RETURN(std::vector<ScaleSearchResult> results,
                           SearchAtScale(cluster, shape, training, space));
  for (const ScaleSearchResult& result : results) {
    std::printf("%s", DescribeScaleSearch(result, flags.top).c_str());
    const ScalePlan& best = result.ranked.front();
    std::printf(
        "best on %d GPUs: %s: %.2f s a step (pipeline %.2f, data-parallel %.2f, optimizer "
        "%.2f), %.1f GiB of %.0f (model states %.1f, activations %.1f), bottleneck %s\n",
        result.gpus, best.Name().c_str(), best.step_ms / 1e3, best.costs.pipeline_ms / 1e3,
        best.costs.data_parallel_ms / 1e3, best.costs.optimizer_ms / 1e3, best.peak_gib,
        cluster.gpu_memory_gib, best.costs.model_state_gib, best.costs.activation_gib,
        BottleneckName(best.bottleneck));
    // The runtime's flags for it: the memory plan recomputes what the cap needs.
    std::printf("  its flags: --device cuda --batch %lld %s --device-memory-gib %g\n",
                static_cast<long long>(training.global_batch), best.choice.Flags().c_str(),
                cluster.gpu_memory_gib - cluster.reserved_gib);
    if (best.choice.tensor_parallel > 1) {
      std::printf(
          "  (the runtime runs --tensor-parallel on CPU workers only so far: on GPUs plan with "
          "--tensor-parallel 1 for a plan it runs today)\n");
    }
  }
  return Status::Ok();
}

Status Plan(const PlanCommandFlags& flags) {
  if (!flags.cluster.empty()) return PlanAtScale(flags);
  if (flags.model != "gpt2" && flags.model != "unet3d") {
    return InvalidArgument(
        "--model {} is planned on a described cluster: add --cluster FILE.yaml "
        "(examples/clusters/); without it --model is gpt2 or unet3d",
        flags.model);
  }
  if (!flags.gpus.empty() || flags.no_overlap) {
    return InvalidArgument(
        "--gpus and --no-overlap belong to the search at scale: add --cluster FILE.yaml, or use "
        "--workers N");
  }
  TESSERA_ASSIGN_OR_RETURN(Device device, ParseDevice(flags.device));
  TESSERA_ASSIGN_OR_RETURN(ModelSpec model, BuildModel(flags, !device.is_cpu()));
  TrainingPlan base;
  base.batch = flags.batch > 0 ? flags.batch : 8;
  base.seq_len = flags.model == "gpt2" ? SeqLen(flags) : 1;
  if (!device.is_cpu()) base.device = Device::Cuda(0);
  base.memory.host_bytes = static_cast<int64_t>(flags.host_memory_gib * (1 << 30));
  base.memory.device_bytes = static_cast<int64_t>(flags.device_memory_gib * (1 << 30));

  AutoPlanOptions options;
  options.space.workers = flags.workers;
  options.space.fewer_workers = flags.fewer_workers;
  options.space.tensor_parallel = flags.tensor_parallel;
  if (flags.sequence_parallel == "none") options.space.shard_sequence = {false};
  if (flags.sequence_parallel == "megatron") options.space.shard_sequence = {true};
  options.space.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  TESSERA_ASSIGN_OR_RETURN(Settings settings, Settings::FromProcessEnvironment());
  options.cache_dir = DefaultCacheDir(settings.cache_dir);
  options.recalibrate = flags.recalibrate;
  options.calibration_rounds = flags.calibration_rounds;
  ExecutorOptions executor = ExecutorOptions::FromSettings(settings);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  executor.threads = flags.threads > 0 ? flags.threads : std::max(1, cores / flags.workers);
  options.threads = executor.threads;

  // Where the probes run: the cluster at --address, a local one, or nowhere.
  std::unique_ptr<Cluster> cluster;
  if (!flags.address.empty()) {
    ConnectOptions connect;
    connect.token_file = flags.token_file;
    TESSERA_ASSIGN_OR_RETURN(cluster, Cluster::Connect(flags.address, connect));
  } else if (!flags.no_probe && flags.workers >= 2) {
    LocalClusterOptions local;
    local.cpu_workers = flags.workers;
    if (!device.is_cpu()) local.gpu_workers = flags.workers;
    local.threads_per_worker = executor.threads;
    local.bind_cores = flags.bind_cores;
    std::fprintf(stderr, "tessera plan: starting %d local workers for the calibration probes\n",
                 flags.workers);
    TESSERA_ASSIGN_OR_RETURN(cluster, Cluster::StartLocal(local));
  }
  std::vector<WorkerId> workers;
  BackendFactory make_backend;
  if (cluster != nullptr) {
    make_backend = [&cluster] {
      return MakeClusterBackend(*cluster, ClusterPlacement::kScheduler);
    };
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<GraphBackend> backend, make_backend());
    workers = backend->workers();
    TESSERA_ASSIGN_OR_RETURN(const ClusterInfo info, cluster->Info());
    options.cluster = info.workers;
    if (static_cast<int>(workers.size()) < flags.workers) {
      return InvalidArgument(
          "--workers {}: the cluster at {} has {} worker(s); start more or plan for fewer",
          flags.workers, flags.address, workers.size());
    }
  } else if (flags.workers >= 2) {
    std::fprintf(stderr,
                 "tessera plan: --no-probe: the collectives, pushes between workers and workers "
                 "sharing a machine are not measured, so communication is priced as free\n");
  }
  TESSERA_ASSIGN_OR_RETURN(AutoPlan chosen,
                           ChooseAutoPlan(model, base, options, executor, workers, make_backend,
                                          [](const std::string& line) {
                                            std::fprintf(stderr, "tessera plan: calibrating: %s\n",
                                                         line.c_str());
                                          }));
  std::printf("%s, batch %lld%s on %d worker(s); calibration %s\n", flags.model.c_str(),
              static_cast<long long>(base.batch),
              flags.model == "gpt2" ? fmt::format(" x {} tokens", SeqLen(flags)).c_str() : "",
              flags.workers, chosen.calibration_source.c_str());
  std::printf("%s", DescribeSearch(chosen.search, flags.top).c_str());
  std::printf("best: %s\n", chosen.why.c_str());
  return Status::Ok();
}

}  // namespace

CLI::App* AddPlanCommand(CLI::App& app, PlanCommandFlags& flags) {
  CLI::App* command = app.add_subcommand(
      "plan",
      "The best parallel plans of a model on N workers, by simulating every plan that fits "
      "the memory caps on costs measured on the cluster: predicted step time, peak per tier, "
      "bottleneck, and the flags that run the best (train_gpt2 --plan auto runs it). With "
      "--cluster FILE.yaml: on a described cluster of GPUs, for a large transformer");
  command
      ->add_option("--model", flags.model,
                   "gpt2 or unet3d; with --cluster: gpt3-175b, megatron-76b, llama2-70b, "
                   "gpt2-1.5b")
      ->check(CLI::IsMember(
          {"gpt2", "unet3d", "gpt3-175b", "megatron-76b", "llama2-70b", "gpt2-1.5b"}));
  command->add_option("--preset", flags.preset,
                      "The model's preset (gpt2: tiny, small, gpt2-124m; unet3d: tiny, small)");
  command->add_option("--layers", flags.layers, "Transformer blocks (overrides the preset)")
      ->check(AtLeast(1));
  command->add_option("--channels", flags.channels, "Width (overrides the preset)")
      ->check(AtLeast(1));
  command->add_option("--heads", flags.heads, "Attention heads (overrides the preset)")
      ->check(AtLeast(1));
  command->add_option("--vocab", flags.vocab, "Vocabulary (overrides the preset)")
      ->check(AtLeast(1));
  command
      ->add_option("--batch", flags.batch,
                   "Global batch (sequences or volumes per step; default 8, with --cluster the "
                   "model's published batch)")
      ->check(AtLeast(1));
  command
      ->add_option("--seq-len", flags.seq_len,
                   "Tokens per sequence (default 64 for gpt2, the preset's with --cluster)")
      ->check(AtLeast(1));
  command->add_option("--workers", flags.workers, "Workers to plan for")->check(AtLeast(1));
  command
      ->add_option("--host-memory-gib", flags.host_memory_gib,
                   "Per worker, the host memory a step may use (0: uncapped)")
      ->check(CLI::NonNegativeNumber);
  command
      ->add_option("--device-memory-gib", flags.device_memory_gib,
                   "Per GPU worker, the GPU memory a step may use (0: uncapped)")
      ->check(CLI::NonNegativeNumber);
  command->add_option("--device", flags.device, "cpu, or cuda: GPU workers");
  command->add_option("--top", flags.top, "How many plans to list")->check(AtLeast(1));
  command->add_option("--address", flags.address,
                      "Calibrate on the cluster at HOST:PORT (default: a local cluster of "
                      "--workers CPU workers started for it)");
  command->add_option("--token-file", flags.token_file, "With --address: the cluster token");
  command->add_flag("--no-probe", flags.no_probe,
                    "Calibrate in this process only (links and sharing unmeasured)");
  command->add_flag("--recalibrate", flags.recalibrate,
                    "Measure again instead of using the cached calibration");
  command
      ->add_option("--calibration-rounds", flags.calibration_rounds,
                   "Rounds of every calibration measurement (a figure is the median of its "
                   "rounds')")
      ->check(AtLeast(1));
  command->add_flag("--fewer-workers", flags.fewer_workers,
                    "Also plans on fewer than --workers (when workers share a machine, fewer can "
                    "be faster)");
  command
      ->add_option("--threads", flags.threads,
                   "Threads per worker (0: the machine's cores over the workers)")
      ->check(AtLeast(0));
  command->add_flag("--bind-cores", flags.bind_cores,
                    "The probes' local workers each bound to cores of their own (as train_gpt2 "
                    "--bind-cores): plan for workers that will run so");
  command->add_option("--cluster", flags.cluster,
                      "A described cluster (YAML: nodes, GPUs, memory, FLOP/s, links; see "
                      "examples/clusters/): search at scale by simulation, nothing is probed");
  command->add_option("--gpus", flags.gpus, "With --cluster: GPU counts to plan for (default: all)")
      ->check(AtLeast(1));
  command
      ->add_option("--tensor-parallel", flags.tensor_parallel,
                   "The tensor-parallel degrees to plan (default: with --cluster 1 2 4 8, those "
                   "that split the layers inside a node; else 1 and the divisors of --workers "
                   "the model splits over)")
      ->check(AtLeast(1));
  command
      ->add_option("--sequence-parallel", flags.sequence_parallel,
                   "auto (plans with T > 1 with and without Megatron-LM's sequence parallelism, "
                   "the norms and residuals on 1/T of each sequence), megatron (only with) or "
                   "none (only without)")
      ->check(CLI::IsMember({"auto", "megatron", "none"}));
  command->add_flag("--no-overlap", flags.no_overlap,
                    "With --cluster: price collectives as not overlapping the compute");
  return command;
}

int RunPlanCommand(const PlanCommandFlags& flags) {
  if (Status status = Plan(flags); !status.ok()) {
    std::fprintf(stderr, "tessera plan: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace tessera
