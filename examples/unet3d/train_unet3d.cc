// train_unet3d: trains a 3D U-Net (model/unet3d.h, built with the model API) to segment
// procedurally generated volumes (data/volumes.h: spheres and boxes in noise, made by this
// program, no download). Prints the loss and the Dice score of each step's batch (hard Dice on
// the argmax over classes 1..C-1), and a held-out Dice at the end.
//
//   train_unet3d                                   # tiny U-Net, this process
//   train_unet3d --workers 4 --zero-stage 3        # a local cluster of 4 workers, ZeRO-3
//   train_unet3d --checkpoint-dir ckpt --resume    # continue a run
//
// The plan flags are train_gpt2's: --workers --zero-stage --offload --micro-batches, the
// pipeline flags (examples/pipeline_flags.h), --checkpoint-dir --checkpoint-every --resume.
#include <cstdio>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "data/volumes.h"
#include "examples/pipeline_flags.h"
#include "examples/trace_flags.h"
#include "model/unet3d.h"
#include "ops/cpu/cpu_kernels.h"
#include "ops/cpu/volume_kernels.h"
#include "training/checkpoint.h"
#include "training/trainer.h"

namespace {

struct Flags {
  std::string preset = "tiny";
  int64_t steps = 200;
  int64_t batch = 4;
  double lr = 3e-3;
  uint64_t seed = 1;
  int workers = 0;  // 0: this process
  int threads = 0;
  int zero_stage = 0;
  std::string offload = "none";
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  bool resume = false;
  int64_t log_every = 1;
  tessera::examples::PipelineFlags pipeline;
  tessera::examples::TraceFlags trace;
};

int Fail(const tessera::Status& status) {
  std::fprintf(stderr, "train_unet3d: %s\n", status.ToString().c_str());
  return 1;
}

// The step's batch: `batch` volumes of the generator's stream, from sample step * batch on.
tessera::Result<std::vector<tessera::Tensor>> Batch(const tessera::UNet3dConfig& config,
                                                    int64_t batch, uint64_t seed) {
  TESSERA_ASSIGN_OR_RETURN(
      tessera::VolumeBatch volumes,
      tessera::GenerateVolumes(batch, config.volume, config.in_channels, seed));
  const int64_t v = config.volume;
  TESSERA_ASSIGN_OR_RETURN(
      tessera::Tensor x, tessera::Tensor::FromVector(
                             tessera::Shape{batch, config.in_channels, v, v, v}, volumes.volumes));
  TESSERA_ASSIGN_OR_RETURN(tessera::Tensor y, tessera::Tensor::FromVector(
                                                  tessera::Shape{batch, v, v, v}, volumes.labels));
  return std::vector<tessera::Tensor>{x, y};
}

tessera::Result<float> Dice(tessera::Trainer& trainer, const std::vector<tessera::Tensor>& batch,
                            const tessera::UNet3dConfig& config) {
  TESSERA_ASSIGN_OR_RETURN(tessera::Tensor logits, trainer.Predict(batch));
  const int64_t voxels = config.volume * config.volume * config.volume;
  return tessera::cpu::DiceScore(logits.data<float>(), batch[1].data<int32_t>(),
                                 batch[1].shape()[0], config.classes, voxels);
}

int Run(const Flags& flags) {
  tessera::Result<tessera::UNet3dConfig> config = tessera::UNet3dConfig::Preset(flags.preset);
  if (!config.ok()) return Fail(config.status());
  tessera::Result<tessera::OpRegistry> registry = tessera::MakeCpuOpRegistry();
  if (!registry.ok()) return Fail(registry.status());
  tessera::Result<tessera::ModelSpec> model = tessera::BuildUNet3d(*config, *registry);
  if (!model.ok()) return Fail(model.status());
  tessera::Result<tessera::OffloadMode> offload = tessera::ParseOffload(flags.offload);
  if (!offload.ok()) return Fail(offload.status());

  tessera::TrainingPlan plan;
  plan.batch = flags.batch;
  plan.optimizer.weight_decay = 0.0;
  plan.parallel.data_parallel = std::max(1, flags.workers);
  plan.parallel.zero_stage = flags.zero_stage;
  plan.parallel.offload = *offload;
  if (tessera::Status piped =
          tessera::examples::ApplyPipelineFlags(flags.pipeline, flags.workers, plan);
      !piped.ok()) {
    return Fail(piped);
  }
  if (tessera::Status valid = plan.Validate(*model); !valid.ok()) return Fail(valid);
  tessera::ExecutorOptions executor;
  executor.threads = flags.threads;
  if (tessera::Status balanced =
          tessera::examples::ApplyBalance(flags.pipeline, *model, executor, "train_unet3d", plan);
      !balanced.ok()) {
    return Fail(balanced);
  }

  std::unique_ptr<tessera::Cluster> cluster;
  std::unique_ptr<tessera::GraphBackend> backend;
  if (flags.workers > 0) {
    tessera::LocalClusterOptions local;
    local.cpu_workers = flags.workers;
    local.threads_per_worker = flags.threads;
    auto started = tessera::Cluster::StartLocal(local);
    if (!started.ok()) return Fail(started.status());
    cluster = std::move(*started);
    if (!cluster->dashboard_url().empty()) {
      std::fprintf(stderr, "train_unet3d: dashboard %s\n", cluster->dashboard_url().c_str());
    }
    auto made = tessera::MakeClusterBackend(*cluster);
    if (!made.ok()) return Fail(made.status());
    backend = std::move(*made);
  } else {
    auto made = tessera::MakeInProcessBackend(executor);
    if (!made.ok()) return Fail(made.status());
    backend = std::move(*made);
  }
  auto trainer = tessera::Trainer::Create(*model, plan, std::move(backend));
  if (!trainer.ok()) return Fail(trainer.status());
  if (tessera::Status init = (*trainer)->InitializeParameters(flags.seed); !init.ok()) {
    return Fail(init);
  }
  std::printf("U-Net 3D %s: %lld parameters, volumes %lld^3, batch %lld, %s\n",
              config->ToString().c_str(), static_cast<long long>(model->NumParameters()),
              static_cast<long long>(config->volume), static_cast<long long>(flags.batch),
              plan.parallel.ToString().c_str());
  if (std::string pipeline = tessera::examples::DescribePipeline((*trainer)->step_graph(), *model);
      !pipeline.empty()) {
    std::printf("pipeline %s\n", pipeline.c_str());
  }
  int64_t first = 1;
  if (flags.resume) {
    if (flags.checkpoint_dir.empty())
      return Fail(tessera::InvalidArgument("--resume needs --checkpoint-dir"));
    auto loaded = tessera::LoadCheckpoint(**trainer, flags.checkpoint_dir);
    if (!loaded.ok()) return Fail(loaded.status());
    first = loaded->step + 1;
    std::printf("resumed from %s (step %lld)\n", loaded->path.c_str(),
                static_cast<long long>(loaded->step));
  }
  for (int64_t step = first; step <= flags.steps; ++step) {
    auto batch = Batch(*config, flags.batch, flags.seed * 1'000'003 + static_cast<uint64_t>(step));
    if (!batch.ok()) return Fail(batch.status());
    auto report = (*trainer)->Step(*batch, static_cast<float>(flags.lr));
    if (!report.ok()) return Fail(report.status());
    if (cluster) {
      // For the scheduler's dashboard and /metrics (one-way; a lost connection fails the next
      // step).
      (void)cluster->ReportProgress(
          {.job = "train_unet3d",
           .step = step,
           .loss = report->loss,
           .step_ms = report->step_ms,
           .samples_per_second = static_cast<double>(flags.batch) / (report->step_ms / 1000.0)});
    }
    if (step % flags.log_every == 0 || step == flags.steps || step == first) {
      auto dice = Dice(**trainer, *batch, *config);
      if (!dice.ok()) return Fail(dice.status());
      std::printf("step %lld/%lld loss %.4f dice %.4f  %.1f ms\n", static_cast<long long>(step),
                  static_cast<long long>(flags.steps), report->loss, *dice, report->step_ms);
      std::fflush(stdout);
    }
    const bool last = step == flags.steps;
    if (!flags.checkpoint_dir.empty() &&
        (last || (flags.checkpoint_every > 0 && step % flags.checkpoint_every == 0))) {
      auto saved = tessera::SaveCheckpoint(**trainer, flags.checkpoint_dir, "");
      if (!saved.ok()) return Fail(saved.status());
      std::printf("checkpoint %s\n", saved->c_str());
    }
  }
  // Held out: volumes from another stream of the generator.
  auto held_out = Batch(*config, flags.batch, flags.seed * 7'777'777 + 1);
  if (!held_out.ok()) return Fail(held_out.status());
  auto loss = (*trainer)->EvalLoss(*held_out);
  auto dice = Dice(**trainer, *held_out, *config);
  if (!loss.ok() || !dice.ok()) return Fail(loss.ok() ? dice.status() : loss.status());
  std::printf("held-out: loss %.4f dice %.4f\n", *loss, *dice);
  tessera::Result<std::string> traced = tessera::examples::WriteStepTrace(**trainer, flags.trace);
  if (!traced.ok()) return Fail(traced.status());
  if (!traced->empty()) std::fprintf(stderr, "train_unet3d: %s\n", traced->c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  CLI::App app{"Train a 3D U-Net on generated segmentation volumes (spheres and boxes)"};
  app.add_option("--preset", flags.preset, "Model preset: tiny, small");
  app.add_option("--steps", flags.steps, "Training steps")->check(CLI::NonNegativeNumber);
  app.add_option("--batch", flags.batch, "Volumes per step")->check(CLI::PositiveNumber);
  app.add_option("--lr", flags.lr, "Learning rate (AdamW, constant)")->check(CLI::PositiveNumber);
  app.add_option("--seed", flags.seed, "Seed for initialisation and data");
  app.add_option("--workers", flags.workers, "Start a local cluster of N workers (0: in process)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--threads", flags.threads, "CPU threads per worker (0: cores / workers)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--zero-stage", flags.zero_stage, "ZeRO stage 0-3")->check(CLI::Range(0, 3));
  app.add_option("--offload", flags.offload, "Optimizer offload: none, optimizer");
  tessera::examples::AddPipelineFlags(app, flags.pipeline);
  app.add_option("--checkpoint-dir", flags.checkpoint_dir, "Save checkpoints here");
  app.add_option("--checkpoint-every", flags.checkpoint_every, "Steps between checkpoints (0: end)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--resume", flags.resume, "Continue from the latest checkpoint in --checkpoint-dir");
  app.add_option("--log-every", flags.log_every, "Print every N-th step")
      ->check(CLI::PositiveNumber);
  tessera::examples::AddTraceFlags(app, flags.trace);
  CLI11_PARSE(app, argc, argv);
  return Run(flags);
}
