// train_gpt2: trains a GPT-2 model with Tessera and prints its progress.
//
//   build/bin/train_gpt2                          # tiny model on the bundled Shakespeare text
//   build/bin/train_gpt2 --preset small --steps 500 --eval-every 100 --sample 300
//   build/bin/train_gpt2 --data train.bin --preset gpt2-124m --seq-len 64 --batch 4
//   build/bin/train_gpt2 --init-from gpt2_124M.bin --steps 20 --export tuned.bin   # llm.c files
//
// Every step prints "step i/N loss X  T ms  K tok/s"; the run ends with one summary line
//   summary: steps=N step_ms_median=X tokens_per_s=Y final_loss=Z peak_mb=M [gpu_peak_mb=G]
// (peak_mb: the largest host-memory peak of the executor of any process that ran steps;
// gpu_peak_mb, with --device cuda in this process: the largest GPU-memory peak of a step.)
// Diagnostics go to stderr, so stdout stays easy to parse.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "core/logging.h"
#include "core/settings.h"
#include "examples/pipeline_flags.h"
#include "examples/trace_flags.h"
#include "training/checkpoint.h"
#include "training/recovery.h"
#include "training/token_dataset.h"
#include "training/trainer.h"
#include "worker/gpu.h"

namespace {

using tessera::Gpt2Config;
using tessera::Status;

#ifndef TESSERA_DEFAULT_DATA
#define TESSERA_DEFAULT_DATA "data/tinyshakespeare.txt"
#endif

struct Flags {
  std::string preset = "tiny";
  int64_t layers = 0, channels = 0, heads = 0, vocab = 0, seq_len = 0, batch = 0;
  int64_t max_seq_len = 0;
  int64_t steps = 200;
  double lr = 1e-3;
  double weight_decay = 0.1;
  double grad_clip = 1.0;
  std::string optimizer = "adamw";
  uint64_t seed = 1337;
  int threads = 0;
  std::string data = TESSERA_DEFAULT_DATA;
  double val_fraction = 0.1;
  int64_t eval_every = 0;
  int64_t eval_batches = 8;
  int64_t sample = 0;
  double temperature = 1.0;
  std::string prompt = "\n";
  int64_t log_every = 1;
  int workers = 0;
  int zero_stage = 0;
  std::string offload = "none";
  std::string device = "cpu";  // cpu, cuda or cuda:N
  double gpu_memory_gib = 0;   // cap on the GPU allocator (0: the card's free memory less 1 GiB)
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  bool resume = false;
  std::string address;
  std::string token_file;
  std::string placement = "scheduler";
  int max_restarts = 0;
  int min_workers = 1;
  bool replace_workers = false;
  int snapshot_every = 0;         // with --max-restarts: a peer snapshot every N steps
  int replacement_grace_ms = -1;  // -1: none on a local cluster, unless replacing; else 10 s
  std::string init_from;          // an llm.c GPT-2 checkpoint: the model and its parameters
  std::string export_path;        // where to write the trained parameters in llm.c's format
  bool preset_given = false;      // --preset on the command line (not the default)
  tessera::examples::PipelineFlags pipeline;
  tessera::examples::TraceFlags trace;
};

struct ResolvedShape {
  Gpt2Config config;
  int64_t batch = 0;
  int64_t seq_len = 0;
};

// --init-from: the model is the one in the file; model flags may repeat it but not change it.
tessera::Result<ResolvedShape> ResolveShapeFromFile(const Flags& flags) {
  ResolvedShape shape;
  TESSERA_ASSIGN_OR_RETURN(shape.config, tessera::ReadLlmcConfig(flags.init_from));
  const Gpt2Config& config = shape.config;
  const struct {
    const char* flag;
    const char* field;  // as Gpt2Config::ToString names it
    int64_t given;      // 0: not given
    int64_t saved;
  } dimensions[] = {{"--layers", "layers", flags.layers, config.layers},
                    {"--channels", "channels", flags.channels, config.channels},
                    {"--heads", "heads", flags.heads, config.heads},
                    {"--vocab", "vocab", flags.vocab, config.vocab},
                    {"--max-seq-len", "max_seq_len", flags.max_seq_len, config.max_seq_len}};
  for (const auto& dimension : dimensions) {
    if (dimension.given != 0 && dimension.given != dimension.saved) {
      return tessera::InvalidArgument(
          "{} {} conflicts with --init-from '{}', which holds a model with {}={} ({}): the "
          "model's shape comes from the file, drop {}",
          dimension.flag, dimension.given, flags.init_from, dimension.field, dimension.saved,
          config.ToString(), dimension.flag);
    }
  }
  if (flags.preset_given) {
    TESSERA_ASSIGN_OR_RETURN(Gpt2Config preset, Gpt2Config::Preset(flags.preset));
    if (preset != config) {
      return tessera::InvalidArgument(
          "--preset {} ({}) conflicts with --init-from '{}', which holds a model with {}: the "
          "model's shape comes from the file, drop --preset",
          flags.preset, preset.ToString(), flags.init_from, config.ToString());
    }
  }
  // The presets' defaults: a GPT-2 124M-sized model trains on a CPU-sized context.
  const bool big = config.NumParameters() > 50'000'000;
  shape.batch = flags.batch ? flags.batch : (big ? 4 : 8);
  shape.seq_len = flags.seq_len ? flags.seq_len : (big ? 64 : config.max_seq_len);
  if (shape.seq_len > config.max_seq_len) {
    return tessera::InvalidArgument("--seq-len {} exceeds the {} positions of the model in '{}'",
                                    shape.seq_len, config.max_seq_len, flags.init_from);
  }
  return shape;
}

// Preset values, overridden by any dimension flag given explicitly.
tessera::Result<ResolvedShape> ResolveShape(const Flags& flags) {
  if (!flags.init_from.empty()) return ResolveShapeFromFile(flags);
  ResolvedShape shape;
  TESSERA_ASSIGN_OR_RETURN(shape.config, Gpt2Config::Preset(flags.preset));
  Gpt2Config& config = shape.config;
  const bool big = flags.preset == "gpt2-124m";
  shape.batch = flags.batch ? flags.batch : (big ? 4 : 8);
  // gpt2-124m keeps its 1024 positions but trains on a CPU-sized context by default.
  shape.seq_len = flags.seq_len ? flags.seq_len : (big ? 64 : config.max_seq_len);
  if (flags.layers) config.layers = flags.layers;
  if (flags.channels) config.channels = flags.channels;
  if (flags.heads) config.heads = flags.heads;
  if (flags.vocab) config.vocab = flags.vocab;
  if (flags.max_seq_len) {
    config.max_seq_len = flags.max_seq_len;
  } else if (!big) {
    config.max_seq_len = shape.seq_len;
  }
  if (shape.seq_len > config.max_seq_len) {
    return tessera::InvalidArgument(
        "--seq-len {} exceeds the model's {} positions; raise "
        "--max-seq-len",
        shape.seq_len, config.max_seq_len);
  }
  TESSERA_RETURN_IF_ERROR(config.Validate());
  return shape;
}

std::string Printable(const std::vector<int32_t>& tokens, bool text) {
  std::string out;
  for (int32_t token : tokens) {
    if (!text || token > 255) {
      out += fmt::format("<{}>", token);
    } else if (token == '\n' || token == '\t' || (token >= 32 && token < 127)) {
      out += static_cast<char>(token);
    } else {
      out += fmt::format("\\x{:02x}", token);
    }
  }
  return out;
}

tessera::Result<std::vector<int32_t>> Sample(tessera::Trainer& trainer,
                                             std::vector<int32_t> context, int64_t count,
                                             int64_t seq_len, double temperature, uint64_t seed) {
  const int64_t vocab = trainer.gpt2_config()->vocab;
  std::mt19937_64 rng(seed);
  std::vector<int32_t> generated;
  std::vector<int32_t> window(static_cast<size_t>(seq_len));
  for (int64_t i = 0; i < count; ++i) {
    // The last seq_len tokens, left-aligned and zero-padded: causal attention makes the padding
    // invisible to the position we read.
    const int64_t used = std::min<int64_t>(static_cast<int64_t>(context.size()), seq_len);
    std::fill(window.begin(), window.end(), 0);
    std::copy(context.end() - used, context.end(), window.begin());
    TESSERA_ASSIGN_OR_RETURN(std::vector<float> logits, trainer.Logits(window, 1, seq_len));
    const float* row = logits.data() + (used - 1) * vocab;
    std::vector<double> weights(static_cast<size_t>(vocab));
    const float max_logit = *std::max_element(row, row + vocab);
    for (int64_t v = 0; v < vocab; ++v) {
      weights[static_cast<size_t>(v)] =
          std::exp((static_cast<double>(row[v]) - max_logit) / std::max(temperature, 1e-6));
    }
    std::discrete_distribution<int32_t> pick(weights.begin(), weights.end());
    const int32_t next = pick(rng);
    context.push_back(next);
    generated.push_back(next);
  }
  return generated;
}

int Fail(const Status& status) {
  std::fprintf(stderr, "train_gpt2: error: %s\n", status.ToString().c_str());
  return 1;
}

int Run(const Flags& flags) {
  tessera::Result<ResolvedShape> shape = ResolveShape(flags);
  if (!shape.ok()) return Fail(shape.status());
  Gpt2Config config = shape->config;
  const int64_t batch = shape->batch;
  const int64_t seq_len = shape->seq_len;

  tessera::Result<tessera::Settings> settings = tessera::Settings::FromProcessEnvironment();
  if (!settings.ok()) return Fail(settings.status());
  if (Status status = tessera::SetLogLevel(settings->log_level); !status.ok()) {
    return Fail(status.WithContext("TESSERA_LOG_LEVEL"));
  }
  tessera::ExecutorOptions executor = tessera::ExecutorOptions::FromSettings(*settings);
  if (flags.threads > 0) executor.threads = flags.threads;
  // --device cuda[:N]: the step runs on a GPU (bf16 activations, fp32 master weights and
  // optimizer state): this process's, or with --workers / --address each worker's own (GPU
  // workers: a local cluster's are started on GPU N, or on every GPU in turn for plain cuda).
  tessera::Result<tessera::Device> device = tessera::ParseDevice(flags.device);
  if (!device.ok()) return Fail(device.status().WithContext("--device"));
  const bool gpu_workers = !device->is_cpu() && (flags.workers > 0 || !flags.address.empty());
  if (!device->is_cpu()) {
    config.activations = tessera::GpuActivations();
    if (!gpu_workers) {
      auto gpu =
          tessera::OpenGpu(device->index, static_cast<int64_t>(flags.gpu_memory_gib * (1 << 30)));
      if (!gpu.ok()) return Fail(gpu.status().WithContext("--device " + flags.device));
      executor.device = std::move(*gpu);
    }
  }

  // Data.
  tessera::Result<tessera::TokenDataset> dataset =
      flags.data == "synthetic"
          ? tessera::Result<tessera::TokenDataset>(tessera::TokenDataset::Synthetic(
                std::max<int64_t>(1 << 20, 16 * batch * (seq_len + 1)),
                static_cast<int32_t>(config.vocab), flags.seed))
          : tessera::TokenDataset::Load(flags.data);
  if (!dataset.ok()) return Fail(dataset.status());
  if (dataset->max_token() >= config.vocab) {
    return Fail(tessera::InvalidArgument(
        "data '{}' has token id {} but the vocabulary is {}; use --vocab {} or more",
        dataset->source(), dataset->max_token(), config.vocab, dataset->max_token() + 1));
  }
  auto [train_data, val_data] = dataset->Split(flags.eval_every > 0 ? flags.val_fraction : 0.0);
  auto train_sampler = tessera::BatchSampler::Create(train_data, batch, seq_len, flags.seed);
  if (!train_sampler.ok()) return Fail(train_sampler.status());
  tessera::Result<tessera::BatchSampler> val_sampler =
      flags.eval_every > 0 ? tessera::BatchSampler::Create(val_data, batch, seq_len, flags.seed)
                           : tessera::Result<tessera::BatchSampler>(*train_sampler);
  if (!val_sampler.ok()) return Fail(val_sampler.status());

  // Model.
  tessera::TrainingPlan plan;
  if (!device->is_cpu()) plan.device = tessera::Device::Cuda(0);  // the worker's own GPU
  plan.batch = batch;
  plan.seq_len = seq_len;
  plan.optimizer.weight_decay = flags.weight_decay;
  plan.optimizer.max_grad_norm = flags.grad_clip;
  if (flags.optimizer == "sgd") plan.optimizer.kind = tessera::OptimizerConfig::Kind::kSgd;
  plan.parallel.zero_stage = flags.zero_stage;
  tessera::Result<tessera::OffloadMode> offload = tessera::ParseOffload(flags.offload);
  if (!offload.ok()) return Fail(offload.status());
  plan.parallel.offload = *offload;
  if (*offload == tessera::OffloadMode::kOptimizer && plan.device.is_cpu()) {
    std::fprintf(stderr,
                 "train_gpt2: --offload optimizer: CPU workers already keep the optimizer state "
                 "and update in host memory, so the plan is the same as without it\n");
  }
  // --workers N: N data-parallel ranks, one per worker (layer placement splits one rank).
  if (flags.workers > 0 && flags.placement != "layers") plan.parallel.data_parallel = flags.workers;
  if (Status piped = tessera::examples::ApplyPipelineFlags(flags.pipeline, flags.workers, plan);
      !piped.ok()) {
    return Fail(piped);
  }
  if (flags.resume && !flags.init_from.empty()) {
    return Fail(tessera::InvalidArgument(
        "--init-from and --resume both say where training starts: use one of them"));
  }
  if (flags.resume && flags.checkpoint_dir.empty()) {
    return Fail(tessera::InvalidArgument("--resume needs --checkpoint-dir (where to resume from)"));
  }
  if (flags.max_restarts > 0 && (flags.checkpoint_dir.empty() || flags.workers == 0)) {
    return Fail(tessera::InvalidArgument(
        "--max-restarts recovers a run on a cluster from its checkpoints: it needs --workers "
        "(with --address or a local cluster) and --checkpoint-dir"));
  }
  if (flags.snapshot_every > 0 && flags.max_restarts == 0) {
    return Fail(tessera::InvalidArgument(
        "--snapshot-every keeps state for recovery: it needs --max-restarts K (K >= 1)"));
  }
  if (flags.replace_workers && !flags.address.empty()) {
    return Fail(tessera::InvalidArgument(
        "--replace-workers starts workers of a local cluster; on a running cluster start them "
        "with `tessera start --cpu-workers N` (recovery waits --replacement-grace-ms for them)"));
  }
  if (Status valid = plan.Validate(tessera::DescribeGpt2(config)); !valid.ok()) {
    return Fail(valid);  // refused before any process starts
  }
  if (Status balanced = tessera::examples::ApplyBalance(
          flags.pipeline, tessera::DescribeGpt2(config), executor, "train_gpt2", plan);
      !balanced.ok()) {
    return Fail(balanced);
  }
  // Where the step runs: this process, a local cluster we start, or a running cluster.
  std::unique_ptr<tessera::Cluster> cluster;
  std::unique_ptr<tessera::GraphBackend> backend;
  if (!flags.address.empty() || flags.workers > 0) {
    if (!flags.address.empty()) {
      tessera::ConnectOptions connect;
      connect.token_file = flags.token_file;
      auto connected = tessera::Cluster::Connect(flags.address, connect);
      if (!connected.ok()) return Fail(connected.status());
      cluster = std::move(*connected);
    } else {
      tessera::LocalClusterOptions local;
      local.cpu_workers = flags.workers;
      if (gpu_workers) {
        local.gpu_workers = flags.workers;
        local.gpus = flags.device == "cuda" ? "all" : std::to_string(device->index);
        local.gpu_memory_gib = flags.gpu_memory_gib;
      }
      local.threads_per_worker = flags.threads;
      auto started = tessera::Cluster::StartLocal(local);
      if (!started.ok()) return Fail(started.status());
      cluster = std::move(*started);
      if (!cluster->dashboard_url().empty()) {
        std::fprintf(stderr, "train_gpt2: dashboard %s\n", cluster->dashboard_url().c_str());
      }
    }
    auto made = tessera::MakeClusterBackend(
        *cluster, flags.placement == "layers" ? tessera::ClusterPlacement::kLayersRoundRobin
                                              : tessera::ClusterPlacement::kScheduler);
    if (!made.ok()) return Fail(made.status());
    backend = std::move(*made);
  } else {
    auto made = tessera::MakeInProcessBackend(executor);
    if (!made.ok()) return Fail(made.status());
    backend = std::move(*made);
  }
  auto trainer = tessera::Trainer::Create(config, plan, std::move(backend));
  if (!trainer.ok()) return Fail(trainer.status());
  if (Status init = (*trainer)->InitializeParameters(flags.seed); !init.ok()) return Fail(init);
  if (!flags.init_from.empty()) {
    if (Status imported = tessera::ImportLlmc(**trainer, flags.init_from); !imported.ok()) {
      return Fail(imported);
    }
    std::fprintf(stderr, "train_gpt2: parameters from %s (llm.c checkpoint)\n",
                 flags.init_from.c_str());
  }
  std::fprintf(stderr,
               "train_gpt2: %s, %lld parameters, batch %lld x %lld tokens, %s, data %s "
               "(%lld tokens)\n",
               config.ToString().c_str(), static_cast<long long>(config.NumParameters()),
               static_cast<long long>(batch), static_cast<long long>(seq_len),
               (*trainer)->backend().Describe().c_str(), dataset->source().c_str(),
               static_cast<long long>(dataset->size()));
  std::fprintf(stderr, "train_gpt2: plan %s, micro-batch %lld\n",
               (*trainer)->plan().parallel.ToString().c_str(),
               static_cast<long long>((*trainer)->step_graph().micro_batch_rows));
  if (std::string pipeline =
          tessera::examples::DescribePipeline((*trainer)->step_graph(), (*trainer)->model());
      !pipeline.empty()) {
    std::fprintf(stderr, "train_gpt2: pipeline %s\n", pipeline.c_str());
  }
  int64_t first_step = 1;
  if (flags.resume) {
    tessera::Result<tessera::CheckpointInfo> loaded =
        tessera::LoadCheckpoint(**trainer, flags.checkpoint_dir);
    if (!loaded.ok()) return Fail(loaded.status());
    if (Status restored = train_sampler->RestoreState(loaded->sampler_state); !restored.ok()) {
      return Fail(restored.WithContext(loaded->path));
    }
    first_step = loaded->step + 1;
    std::fprintf(stderr, "train_gpt2: resumed from %s (step %lld)\n", loaded->path.c_str(),
                 static_cast<long long>(loaded->step));
  }
  // Recovery from lost workers (training/recovery.h): back to the last checkpoint, so there is one
  // from the start.
  std::unique_ptr<tessera::StepRecovery> recovery;
  if (flags.max_restarts > 0) {
    tessera::RecoveryOptions recovery_options{
        .max_restarts = flags.max_restarts,
        .min_workers = flags.min_workers,
        // A local cluster gets workers back only if we start them; a running one may get them
        // from its operator.
        .replacement_grace_ms =
            flags.replacement_grace_ms >= 0
                ? flags.replacement_grace_ms
                : (flags.replace_workers ? 30'000 : (flags.address.empty() ? 0 : 10'000)),
        .start_replacements = flags.replace_workers,
        .snapshot_every = flags.snapshot_every};
    if (!flags.address.empty()) {
      // A lost scheduler: its supervisor (`tessera start --head`) starts it again on the same
      // port; connect to it for as long as workers wait for it (scheduler_grace_ms).
      recovery_options.reconnect = [&]() -> tessera::Result<tessera::Cluster*> {
        cluster.reset();
        tessera::ConnectOptions connect;
        connect.token_file = flags.token_file;
        connect.retry_ms = static_cast<int>(settings->scheduler_grace_ms);
        auto connected = tessera::Cluster::Connect(flags.address, connect);
        if (!connected.ok()) {
          return connected.status().WithContext(fmt::format(
              "the scheduler at {} did not come back within {} ms (a cluster started with "
              "`tessera start --head` restarts it; one started with --no-restart does not)",
              flags.address, settings->scheduler_grace_ms));
        }
        cluster = std::move(*connected);
        return cluster.get();
      };
    }
    recovery = std::make_unique<tessera::StepRecovery>(
        *cluster, config, plan,
        flags.placement == "layers" ? tessera::ClusterPlacement::kLayersRoundRobin
                                    : tessera::ClusterPlacement::kScheduler,
        flags.checkpoint_dir, std::move(recovery_options));
  }
  int checkpoints_saved = 0;
  double checkpoint_seconds = 0;
  auto save = [&]() -> Status {
    const auto started = std::chrono::steady_clock::now();
    tessera::Result<std::string> saved =
        tessera::SaveCheckpoint(**trainer, flags.checkpoint_dir, train_sampler->SaveState());
    if (!saved.ok()) return saved.status();
    ++checkpoints_saved;
    checkpoint_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::fprintf(stderr, "train_gpt2: checkpoint %s\n", saved->c_str());
    return Status::Ok();
  };
  if (recovery && !flags.resume) {
    if (Status saved = save(); !saved.ok()) return Fail(saved);
  }
  if (recovery) recovery->AfterStep(**trainer, train_sampler->SaveState(), /*checkpointed=*/true);
  // Per rank: the largest figures of any step, and the last step's bytes sent.
  std::vector<tessera::RankFigures> rank_peaks;
  // When the step of a recovery failed (reported once the next step completes); the clock's
  // epoch when no recovery is in progress.
  std::chrono::steady_clock::time_point failed_at{};

  std::vector<int32_t> tokens(static_cast<size_t>(batch * seq_len));
  std::vector<int32_t> targets(tokens.size());
  std::vector<double> step_ms;
  int64_t peak_bytes = 0, gpu_peak_bytes = 0;
  float last_loss = 0;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed_s = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  double last_progress_s = 0;
  auto evaluate = [&](int64_t step) -> Status {
    double total = 0;
    for (int64_t b = 0; b < flags.eval_batches; ++b) {
      val_sampler->Sequential(b, tokens.data(), targets.data());
      TESSERA_ASSIGN_OR_RETURN(float loss, (*trainer)->EvalLoss(tokens, targets));
      total += loss;
    }
    std::printf("eval step %lld: val_loss %.4f\n", static_cast<long long>(step),
                total / static_cast<double>(flags.eval_batches));
    std::fflush(stdout);
    return Status::Ok();
  };
  // A model that did not start from scratch: how good it is before training.
  if (!flags.init_from.empty() && flags.eval_every > 0) {
    if (Status evaluated = evaluate(0); !evaluated.ok()) return Fail(evaluated);
  }
  for (int64_t i = first_step; i <= flags.steps; ++i) {
    train_sampler->Next(tokens.data(), targets.data());
    tessera::Result<tessera::StepReport> report =
        (*trainer)->Step(tokens, targets, static_cast<float>(flags.lr));
    if (!report.ok() && recovery && recovery->Recoverable(report.status(), **trainer)) {
      if (failed_at == std::chrono::steady_clock::time_point{}) {
        failed_at = std::chrono::steady_clock::now();
      }
      auto recovered = recovery->Recover(i, report.status(), std::move(*trainer));
      if (!recovered.ok()) {
        return Fail(recovered.status().WithContext(fmt::format("recovering from step {}", i)));
      }
      *trainer = std::move(recovered->trainer);
      if (Status rewound = train_sampler->RestoreState(recovered->checkpoint.sampler_state);
          !rewound.ok()) {
        return Fail(rewound.WithContext(recovered->checkpoint.path));
      }
      std::fprintf(stderr, "train_gpt2: %s\n", recovered->report.ToString().c_str());
      rank_peaks.clear();              // the new plan's ranks
      i = recovered->checkpoint.step;  // the loop goes on with the step after it: the replay
      continue;
    }
    if (!report.ok()) return Fail(report.status().WithContext(fmt::format("step {}", i)));
    if (failed_at != std::chrono::steady_clock::time_point{}) {
      std::fprintf(
          stderr,
          "train_gpt2: recovery %d: step %lld completed %.2f s after the failed step "
          "returned\n",
          recovery->restarts(), static_cast<long long>(i),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - failed_at).count());
      failed_at = {};
    }
    step_ms.push_back(report->step_ms);
    // The largest executor peak of any process that ran the step (this one, or each worker).
    peak_bytes = std::max(peak_bytes, report->peak_bytes);
    gpu_peak_bytes = std::max(gpu_peak_bytes, report->device_peak_bytes);
    if (rank_peaks.size() < report->ranks.size()) rank_peaks.resize(report->ranks.size());
    for (size_t r = 0; r < report->ranks.size(); ++r) {
      const tessera::RunFigures& now = report->ranks[r].figures;
      peak_bytes = std::max(peak_bytes, now.allocator_peak);
      tessera::RankFigures& kept = rank_peaks[r];
      kept.rank = report->ranks[r].rank;
      kept.worker = report->ranks[r].worker;
      kept.figures.role_peaks.resize(now.role_peaks.size());
      for (size_t role = 0; role < now.role_peaks.size(); ++role) {
        kept.figures.role_peaks[role] =
            std::max(kept.figures.role_peaks[role], now.role_peaks[role]);
      }
      kept.figures.model_state_peak = std::max(kept.figures.model_state_peak, now.model_state_peak);
      kept.figures.transient_peak = std::max(kept.figures.transient_peak, now.transient_peak);
      kept.figures.collective_bytes_sent = now.collective_bytes_sent;
      kept.figures.pushed_bytes = now.pushed_bytes;
    }
    last_loss = report->loss;
    if (!std::isfinite(report->loss)) {
      return Fail(
          tessera::Internal("loss became {} at step {}; try a lower --lr", report->loss, i));
    }
    if (cluster && cluster->connected()) {
      // For the scheduler's dashboard and /metrics. One-way: a lost connection shows up on the
      // next step, where recovery handles it.
      (void)cluster->ReportProgress(
          {.job = "train_gpt2",
           .step = i,
           .loss = report->loss,
           .step_ms = report->step_ms,
           .tokens_per_second = static_cast<double>(batch * seq_len) / (report->step_ms / 1000.0)});
    }
    if (i % flags.log_every == 0 || i == flags.steps || i == 1) {
      std::printf("step %lld/%lld loss %.4f  %.1f ms  %.0f tok/s\n", static_cast<long long>(i),
                  static_cast<long long>(flags.steps), report->loss, report->step_ms,
                  static_cast<double>(batch * seq_len) / (report->step_ms / 1000.0));
      std::fflush(stdout);
    }
    // A progress line every ~10 s on long runs, with the time left.
    if (elapsed_s() - last_progress_s >= 10.0 && i < flags.steps) {
      last_progress_s = elapsed_s();
      const double eta =
          last_progress_s / static_cast<double>(i) * static_cast<double>(flags.steps - i);
      std::fprintf(stderr, "progress: %lld/%lld steps (%.0f%%), elapsed %.0f s, eta %.0f s\n",
                   static_cast<long long>(i), static_cast<long long>(flags.steps),
                   100.0 * static_cast<double>(i) / static_cast<double>(flags.steps),
                   last_progress_s, eta);
    }
    const bool checkpointed = !flags.checkpoint_dir.empty() && flags.checkpoint_every > 0 &&
                              i % flags.checkpoint_every == 0;
    if (checkpointed) {
      if (Status saved = save(); !saved.ok()) return Fail(saved);
    }
    if (recovery) recovery->AfterStep(**trainer, train_sampler->SaveState(), checkpointed);
    if (flags.eval_every > 0 && (i % flags.eval_every == 0 || i == flags.steps)) {
      if (Status evaluated = evaluate(i); !evaluated.ok()) return Fail(evaluated);
    }
  }

  if (flags.sample > 0) {
    std::vector<int32_t> context;
    for (unsigned char c : flags.prompt) context.push_back(c);
    if (!dataset->is_text() || context.empty()) context = {0};
    for (int32_t& token : context)
      token = std::min<int32_t>(token, static_cast<int32_t>(config.vocab - 1));
    tessera::Result<std::vector<int32_t>> sample =
        Sample(**trainer, context, flags.sample, seq_len, flags.temperature, flags.seed + 1);
    if (!sample.ok()) return Fail(sample.status());
    std::printf("sample:\n%s%s\n", Printable(context, dataset->is_text()).c_str(),
                Printable(*sample, dataset->is_text() && config.vocab <= 256).c_str());
  }

  const bool saved_last = flags.checkpoint_every > 0 && flags.steps % flags.checkpoint_every == 0;
  if (!flags.checkpoint_dir.empty() && (*trainer)->steps_taken() > 0 && !saved_last) {
    if (Status saved = save(); !saved.ok()) return Fail(saved);
  }
  if (!flags.export_path.empty()) {
    if (Status exported = tessera::ExportLlmc(**trainer, flags.export_path); !exported.ok()) {
      return Fail(exported.WithContext("--export"));
    }
    std::fprintf(stderr, "train_gpt2: parameters after step %lld exported to %s (llm.c format)\n",
                 static_cast<long long>((*trainer)->steps_taken()), flags.export_path.c_str());
  }
  tessera::Result<std::string> traced = tessera::examples::WriteStepTrace(**trainer, flags.trace);
  if (!traced.ok()) return Fail(traced.status());
  if (!traced->empty()) std::fprintf(stderr, "train_gpt2: %s\n", traced->c_str());
  const auto mb = [](int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); };
  for (const tessera::RankFigures& rank : rank_peaks) {
    const tessera::RunFigures& f = rank.figures;
    std::printf(
        "worker rank %d%s: peak params %.2f MB, grads %.2f MB, optimizer %.2f MB (model state "
        "%.2f MB), transient %.2f MB; sent %.2f MB/step\n",
        rank.rank, rank.worker.valid() ? (" (" + rank.worker.ToString() + ")").c_str() : "",
        mb(f.peak(tessera::ObjectRole::kParameter)), mb(f.peak(tessera::ObjectRole::kGradient)),
        mb(f.peak(tessera::ObjectRole::kOptimizerState)), mb(f.model_state_peak),
        mb(f.transient_peak), mb(f.collective_bytes_sent + f.pushed_bytes));
  }
  if (checkpoints_saved > 0) {
    std::printf("checkpoints: %d saved, %.1f ms each on average\n", checkpoints_saved,
                1000.0 * checkpoint_seconds / checkpoints_saved);
  }
  if (recovery && recovery->snapshot_stats().taken > 0) {
    const tessera::StepRecovery::SnapshotStats& snapshots = recovery->snapshot_stats();
    std::printf("peer snapshots: %d taken, %.1f ms each on average, %.2f MB held on the workers\n",
                snapshots.taken, 1000.0 * snapshots.seconds / snapshots.taken, mb(snapshots.bytes));
  }
  std::vector<double> sorted = step_ms;
  double median = 0;
  if (!sorted.empty()) {
    // Skip the first step (allocation warm-up) when there are others.
    if (sorted.size() > 1) sorted.erase(sorted.begin());
    std::sort(sorted.begin(), sorted.end());
    median = sorted[sorted.size() / 2];
  }
  const std::string gpu_peak =
      gpu_peak_bytes > 0
          ? fmt::format(" gpu_peak_mb={:.1f}", static_cast<double>(gpu_peak_bytes) / (1 << 20))
          : "";
  std::printf(
      "summary: steps=%lld step_ms_median=%.2f tokens_per_s=%.0f final_loss=%.6f "
      "peak_mb=%.1f%s\n",
      static_cast<long long>(flags.steps), median,
      median > 0 ? static_cast<double>(batch * seq_len) / (median / 1000.0) : 0.0, last_loss,
      static_cast<double>(peak_bytes) / (1024.0 * 1024.0), gpu_peak.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  CLI::App app{
      "Train a GPT-2 model with Tessera: in this process, on a local cluster of worker "
      "processes it starts (--workers N), or on a running cluster (--address), with data "
      "parallelism or ZeRO-1/2/3 (--zero-stage) on CPU workers.\n"
      "Output: one line per step, then 'summary: ...'. Settings such as "
      "TESSERA_CPU_THREADS can also come from the environment:\n" +
      tessera::Settings::Describe()};
  app.option_defaults()->always_capture_default();
  CLI::Option* preset =
      app.add_option("--preset", flags.preset, "Model preset: tiny, small, gpt2-124m")
          ->check(CLI::IsMember({"tiny", "small", "gpt2-124m"}));
  app.add_option("--layers", flags.layers, "Transformer blocks (overrides the preset)")
      ->check(CLI::PositiveNumber);
  app.add_option("--channels", flags.channels, "Embedding width")->check(CLI::PositiveNumber);
  app.add_option("--heads", flags.heads, "Attention heads (must divide --channels)")
      ->check(CLI::PositiveNumber);
  app.add_option("--vocab", flags.vocab, "Vocabulary size (>= 256 for byte-level text)")
      ->check(CLI::PositiveNumber);
  app.add_option("--seq-len", flags.seq_len, "Tokens per sequence")->check(CLI::PositiveNumber);
  app.add_option("--max-seq-len", flags.max_seq_len,
                 "Positions in the position embedding (default: the preset's or --seq-len)")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", flags.batch, "Sequences per step")->check(CLI::PositiveNumber);
  app.add_option("--steps", flags.steps, "Training steps")->check(CLI::NonNegativeNumber);
  app.add_option("--lr", flags.lr, "Learning rate (constant)")->check(CLI::PositiveNumber);
  app.add_option("--weight-decay", flags.weight_decay, "AdamW weight decay on matrices")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--grad-clip", flags.grad_clip, "Global gradient-norm bound (0: off)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--optimizer", flags.optimizer, "adamw or sgd")
      ->check(CLI::IsMember({"adamw", "sgd"}));
  app.add_option("--seed", flags.seed, "Seed for initialisation, batches and sampling");
  app.add_option("--threads", flags.threads, "CPU threads (0: one per core)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--data", flags.data,
                 "Text file (tokenized as bytes), llm.c .bin token file, or 'synthetic'");
  app.add_option("--val-fraction", flags.val_fraction,
                 "Share of the data held out for --eval-every")
      ->check(CLI::Range(0.0, 0.5));
  app.add_option("--eval-every", flags.eval_every, "Validation loss every N steps (0: never)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--eval-batches", flags.eval_batches, "Batches per validation")
      ->check(CLI::PositiveNumber);
  app.add_option("--sample", flags.sample, "Generate N tokens after training")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--temperature", flags.temperature, "Sampling temperature")
      ->check(CLI::PositiveNumber);
  app.add_option("--prompt", flags.prompt, "Text that starts the sample");
  app.add_option("--log-every", flags.log_every, "Print every N-th step line")
      ->check(CLI::PositiveNumber);
  CLI::Option* workers =
      app.add_option("--workers", flags.workers,
                     "N data-parallel workers: a local cluster of N CPU worker processes, or N "
                     "workers of --address (0: in this process)")
          ->check(CLI::NonNegativeNumber);
  bool in_process = false;
  CLI::Option* in_process_flag =
      app.add_flag("--in-process", in_process,
                   "Train in this process: no scheduler or worker processes (the default when "
                   "neither --workers nor --address is given)")
          ->excludes(workers);
  app.add_option("--zero-stage", flags.zero_stage,
                 "With --workers: 0 data parallel, 1 shard optimizer state, 2 + gradients, "
                 "3 + parameters");
  app.add_option("--offload", flags.offload,
                 "none, or optimizer: master weights, Adam state and the update in the host "
                 "tier and on the CPU (ZeRO-Offload; on CPU workers nothing moves)");
  app.add_option("--device", flags.device,
                 "cpu, or cuda / cuda:N: train on a GPU (bf16 activations, fp32 master "
                 "weights and AdamW state): this process's, or with --workers N each worker's "
                 "(a local cluster of N GPU workers on GPU N, or on every GPU in turn)");
  app.add_option("--gpu-memory-gib", flags.gpu_memory_gib,
                 "With --device cuda: cap on the GPU memory the allocator hands out (0: the "
                 "card's free memory less 1 GiB)")
      ->check(CLI::NonNegativeNumber);
  tessera::examples::AddPipelineFlags(app, flags.pipeline);
  app.add_option("--checkpoint-dir", flags.checkpoint_dir,
                 "Save checkpoints here (at the end, and every --checkpoint-every steps)");
  app.add_option("--checkpoint-every", flags.checkpoint_every, "Steps between checkpoints (0: end)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--resume", flags.resume,
               "Continue from the latest checkpoint in --checkpoint-dir (any --workers and "
               "--zero-stage)");
  app.add_option("--address", flags.address, "Run on the cluster at HOST:PORT")
      ->excludes(in_process_flag);
  app.add_option("--token-file", flags.token_file,
                 "With --address: the cluster token (default: the latest session's)");
  app.add_option("--max-restarts", flags.max_restarts,
                 "Recover from lost workers (and, with --address, a restarted scheduler) up to K "
                 "times: re-plan on the workers there are and resume from the last checkpoint "
                 "(needs --workers and --checkpoint-dir)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--min-workers", flags.min_workers,
                 "With --max-restarts: give up when fewer workers than this remain")
      ->check(CLI::PositiveNumber);
  app.add_flag("--replace-workers", flags.replace_workers,
               "With --max-restarts on a local cluster: start a worker for each one lost");
  app.add_option("--snapshot-every", flags.snapshot_every,
                 "With --max-restarts: every N steps (and at every checkpoint) keep the state in "
                 "memory on the workers, each piece also on the next rank's worker, and recover "
                 "from it instead of the disk checkpoint when it survives (0: off)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--replacement-grace-ms", flags.replacement_grace_ms,
                 "With --max-restarts: how long to wait for the cluster to be back at --workers "
                 "before going on with fewer (default: 0 on a local cluster, 30000 with "
                 "--replace-workers, 10000 with --address)")
      ->check(CLI::Range(-1, 3'600'000));
  app.add_option("--init-from", flags.init_from,
                 "Start from the parameters of an llm.c fp32 GPT-2 checkpoint (gpt2_124M.bin's "
                 "format); the model's shape comes from its header (model flags may only repeat "
                 "it), the optimizer state starts fresh");
  app.add_option("--export", flags.export_path,
                 "After training, write the parameters to this file in llm.c's fp32 GPT-2 "
                 "checkpoint format (for llm.c or --init-from)");
  tessera::examples::AddTraceFlags(app, flags.trace);
  app.add_option("--placement", flags.placement,
                 "On a cluster: scheduler (tasks follow their inputs) or layers (layer by layer "
                 "round-robin over the workers)")
      ->check(CLI::IsMember({"scheduler", "layers"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "train_gpt2: %s\n\n%s", e.what(), app.help().c_str());
    return 2;
  }
  flags.preset_given = preset->count() > 0;
  return Run(flags);
}
