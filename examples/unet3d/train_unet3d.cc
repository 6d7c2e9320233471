// train_unet3d: trains a 3D U-Net (model/unet3d.h, built with the model API) to segment
// procedurally generated volumes (data/volumes.h: spheres and boxes in noise, made by this
// program, no download). Prints the loss and the Dice score of each step's batch (hard Dice on
// the argmax over classes 1..C-1), a held-out Dice at the end, and one summary line
//   summary: steps=N step_ms_median=X samples_per_s=Y final_loss=Z peak_mb=M steps_s=S
//
//   train_unet3d                                   # tiny U-Net, this process
//   train_unet3d --workers 4 --zero-stage 3        # a local cluster of 4 workers, ZeRO-3
//   train_unet3d --checkpoint-dir ckpt --resume    # continue a run
//
// The plan, cluster, checkpoint and trace flags are train_gpt2's (examples/common/flags.h).
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "core/flag_checks.h"
#include "core/run_main.h"
#include "data/volumes.h"
#include "examples/common/flags.h"
#include "examples/common/session.h"
#include "examples/common/training_loop.h"
#include "model/unet3d.h"
#include "ops/cpu/cpu_kernels.h"
#include "ops/cpu/volume_kernels.h"
#include "training/checkpoint.h"
#include "training/trainer.h"

namespace {

using tessera::Result;
using tessera::Status;
namespace examples = tessera::examples;

constexpr const char* kProgram = "train_unet3d";

struct Flags {
  std::string preset = "tiny";
  int64_t steps = 200;
  int64_t batch = 4;
  double lr = 3e-3;
  uint64_t seed = 1;
  examples::CommonFlags common;
};

// The step's batch: `batch` volumes of the generator's stream, from sample step * batch on.
Result<std::vector<tessera::Tensor>> Batch(const tessera::UNet3dConfig& config, int64_t batch,
                                           uint64_t seed) {
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

Result<float> Dice(tessera::Trainer& trainer, const std::vector<tessera::Tensor>& batch,
                   const tessera::UNet3dConfig& config) {
  TESSERA_ASSIGN_OR_RETURN(tessera::Tensor logits, trainer.Predict(batch));
  const int64_t voxels = config.volume * config.volume * config.volume;
  return tessera::cpu::DiceScore(logits.data<float>(), batch[1].data<int32_t>(),
                                 batch[1].shape()[0], config.classes, voxels);
}

Result<tessera::TrainingPlan> MakePlan(const Flags& flags, const tessera::ModelSpec& model,
                                       const examples::Runtime& runtime) {
  tessera::TrainingPlan plan;
  plan.batch = flags.batch;
  plan.optimizer.weight_decay = 0.0;
  TESSERA_RETURN_IF_ERROR(examples::ApplyPlanFlags(flags.common, kProgram, plan));
  TESSERA_RETURN_IF_ERROR(examples::CheckFlagCombinations(flags.common));
  TESSERA_RETURN_IF_ERROR(plan.Validate(model));
  TESSERA_RETURN_IF_ERROR(
      examples::ApplyBalance(flags.common, model, runtime.executor, kProgram, plan));
  return plan;
}

// The loop's hooks: batches from the step number (so a resumed run continues the same stream),
// the step line with the batch's Dice.
examples::TrainingLoop::Hooks LoopHooks(const Flags& flags, const tessera::UNet3dConfig& config,
                                        int64_t first) {
  return {.batch =
              [&flags, &config](int64_t step) {
                return Batch(config, flags.batch,
                             flags.seed * 1'000'003 + static_cast<uint64_t>(step));
              },
          .log_step =
              [&flags, &config, first](tessera::Trainer& trainer, int64_t step,
                                       const tessera::StepReport& report,
                                       const std::vector<tessera::Tensor>& batch) {
                if (step % flags.common.log_every != 0 && step != flags.steps && step != first) {
                  return Status::Ok();
                }
                TESSERA_ASSIGN_OR_RETURN(float dice, Dice(trainer, batch, config));
                std::printf("step %lld/%lld loss %.4f dice %.4f  %.1f ms\n",
                            static_cast<long long>(step), static_cast<long long>(flags.steps),
                            report.loss, dice, report.step_ms);
                std::fflush(stdout);
                return Status::Ok();
              }};
}

Status Train(const Flags& flags) {
  TESSERA_ASSIGN_OR_RETURN(tessera::UNet3dConfig config,
                           tessera::UNet3dConfig::Preset(flags.preset));
  TESSERA_ASSIGN_OR_RETURN(tessera::OpRegistry registry, tessera::MakeCpuOpRegistry());
  TESSERA_ASSIGN_OR_RETURN(tessera::ModelSpec model, tessera::BuildUNet3d(config, registry));
  TESSERA_ASSIGN_OR_RETURN(examples::Runtime runtime, examples::OpenRuntime(flags.common));
  TESSERA_ASSIGN_OR_RETURN(tessera::TrainingPlan plan, MakePlan(flags, model, runtime));
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<examples::Session> session,
                           examples::Session::Open(flags.common, runtime, kProgram));
  TESSERA_RETURN_IF_ERROR(
      examples::UseTheClustersWorkers(flags.common, *session, model, runtime, kProgram, plan));
  TESSERA_RETURN_IF_ERROR(
      examples::ChooseThePlan(flags.common, *session, model, runtime, kProgram, plan));
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<tessera::GraphBackend> backend, session->MakeBackend());
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<tessera::Trainer> trainer,
                           tessera::Trainer::Create(model, plan, std::move(backend)));
  TESSERA_RETURN_IF_ERROR(trainer->InitializeParameters(flags.seed));
  std::printf("U-Net 3D %s: %lld parameters, volumes %lld^3, batch %lld, %s\n",
              config.ToString().c_str(), static_cast<long long>(model.NumParameters()),
              static_cast<long long>(config.volume), static_cast<long long>(flags.batch),
              plan.parallel.ToString().c_str());
  if (std::string pipeline =
          examples::DescribePipeline(trainer->step_graph(), trainer->planned_model());
      !pipeline.empty()) {
    std::printf("pipeline %s\n", pipeline.c_str());
  }
  // Under --tensor-parallel T: each layer's split (every pair of conv blocks Megatron-style).
  if (std::string tensor =
          examples::DescribeTensorParallel(trainer->step_graph(), trainer->planned_model());
      !tensor.empty()) {
    std::printf("%s\n", tensor.c_str());
  }
  if (std::string buckets = examples::DescribeBuckets(trainer->step_graph()); !buckets.empty()) {
    std::printf("gradient buckets %s\n", buckets.c_str());
  }
  TESSERA_RETURN_IF_ERROR(examples::PrintMemoryPlan(*trainer, flags.common.trace));
  examples::Checkpoints checkpoints(flags.common.checkpoints, kProgram);
  TESSERA_ASSIGN_OR_RETURN(std::optional<tessera::CheckpointInfo> resumed,
                           checkpoints.Resume(*trainer));
  const int64_t first = resumed ? resumed->step + 1 : 1;
  examples::TrainingLoop loop({.program = kProgram,
                               .job = kProgram,
                               .steps = flags.steps,
                               .lr = static_cast<float>(flags.lr),
                               .items_per_step = static_cast<double>(flags.batch),
                               .items_are_tokens = false},
                              LoopHooks(flags, config, first), checkpoints, nullptr, *session);
  TESSERA_RETURN_IF_ERROR(loop.Run(trainer, first));
  TESSERA_RETURN_IF_ERROR(checkpoints.SaveAtEnd(*trainer, flags.steps, ""));
  // Held out: volumes from another stream of the generator.
  TESSERA_ASSIGN_OR_RETURN(std::vector<tessera::Tensor> held_out,
                           Batch(config, flags.batch, flags.seed * 7'777'777 + 1));
  TESSERA_ASSIGN_OR_RETURN(float loss, trainer->EvalLoss(held_out));
  TESSERA_ASSIGN_OR_RETURN(float dice, Dice(*trainer, held_out, config));
  std::printf("held-out: loss %.4f dice %.4f\n", loss, dice);
  TESSERA_RETURN_IF_ERROR(examples::WriteStepTrace(*trainer, flags.common.trace, kProgram));
  loop.stats().PrintRanks();
  checkpoints.PrintSummary();
  loop.stats().PrintSummary(flags.steps, "samples_per_s", static_cast<double>(flags.batch));
  return Status::Ok();
}

// The program. main() reports an exception that escapes it (memory running out, a bug) as an
// error instead of terminating.
int Main(int argc, char** argv) {
  Flags flags;
  CLI::App app{"Train a 3D U-Net on generated segmentation volumes (spheres and boxes)"};
  app.add_option("--preset", flags.preset, "Model preset: tiny, small");
  app.add_option("--steps", flags.steps, "Training steps")->check(tessera::AtLeast(0));
  app.add_option("--batch", flags.batch, "Volumes per step")->check(tessera::AtLeast(1));
  app.add_option("--lr", flags.lr, "Learning rate (AdamW, constant)")->check(tessera::AboveZero());
  app.add_option("--seed", flags.seed, "Seed for initialisation and data");
  examples::AddThreadsFlag(app, flags.common);
  examples::AddPlanFlags(app, flags.common);
  examples::AddPipelineFlags(app, flags.common);
  examples::AddCheckpointFlags(app, flags.common);
  examples::AddClusterFlags(app, flags.common);
  examples::AddLogEveryFlag(app, flags.common);
  examples::AddTraceFlags(app, flags.common);
  examples::AddPlacementFlag(app, flags.common);
  if (std::optional<int> exit = examples::ParseFlags(app, argc, argv, kProgram, flags.common)) {
    return *exit;
  }
  if (Status status = Train(flags); !status.ok()) {
    std::fprintf(stderr, "%s: %s\n", kProgram, status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::RunMain(kProgram, [&] { return Main(argc, argv); });
}
