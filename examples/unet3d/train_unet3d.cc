// train_unet3d: trains a 3D U-Net (model/unet3d.h, built with the model API) to segment
// procedurally generated volumes (data/volumes.h: spheres and boxes in noise, made by this
// program, no download), or NIfTI volumes on disk (--data DIR: nnU-Net's or the Medical
// Segmentation Decathlon's layout, data/volume_dataset.h), cropped to the model's volume with
// random flips, each step's batch made while the previous step runs (examples/common/prefetch.h).
// Prints the loss and the Dice score of each step's batch (hard Dice on the argmax over classes
// 1..C-1), a held-out Dice at the end, and one summary line
//   summary: steps=N step_ms_median=X samples_per_s=Y final_loss=Z peak_mb=M steps_s=S
//
//   train_unet3d                                   # tiny U-Net, this process
//   train_unet3d --workers 4 --zero-stage 3        # a local cluster of 4 workers, ZeRO-3
//   train_unet3d --checkpoint-dir ckpt --resume    # continue a run
//   train_unet3d --device cuda                     # on this process's GPU (bf16 activations)
//   train_unet3d --activations bf16                # the GPU's mixed precision, on the CPU
//   train_unet3d --write-volumes vols --cases 8    # generated volumes as NIfTI files, then
//   train_unet3d --data vols                       # train on them
//
// The plan, cluster, checkpoint and trace flags are train_gpt2's (examples/common/flags.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "core/flag_checks.h"
#include "core/half.h"
#include "core/run_main.h"
#include "data/nifti.h"
#include "data/sliding_window.h"
#include "data/volume_dataset.h"
#include "data/volumes.h"
#include "examples/common/flags.h"
#include "examples/common/prefetch.h"
#include "examples/common/session.h"
#include "examples/common/training_loop.h"
#include "model/unet3d.h"
#include "ops/cpu/cpu_kernels.h"
#include "ops/cpu/volume_kernels.h"
#include "training/checkpoint.h"
#include "training/trainer.h"
#include "worker/gpu.h"

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
  std::string data_dir;              // NIfTI volumes; empty: generated ones
  double data_memory_gib = 4;        // the most the loaded volumes may take
  std::string write_volumes;         // write generated volumes here and exit
  int64_t cases = 8;                 // ... this many
  int64_t volume = 0;                // the patch's edge; 0: the preset's
  bool deep_supervision = false;     // nnU-Net's extra heads at coarser decoder levels
  int spatial_parallel = 1;          // slabs each volume's depth splits into, one a worker
  std::string activations = "auto";  // f32, bf16, or auto: bf16 on a GPU, f32 on the CPU
  bool predict = false;              // whole-volume inference after training
  std::string predict_out;           // ... writing the predicted label maps here
  examples::CommonFlags common;
};

// The preset, with --volume in place of its patch size.
Result<tessera::UNet3dConfig> ModelConfig(const Flags& flags) {
  TESSERA_ASSIGN_OR_RETURN(tessera::UNet3dConfig config,
                           tessera::UNet3dConfig::Preset(flags.preset));
  if (flags.volume > 0) config.volume = flags.volume;
  config.deep_supervision = flags.deep_supervision;
  if (flags.activations == "bf16") config.activations = tessera::DType::kBF16;
  TESSERA_RETURN_IF_ERROR(config.Validate().WithContext(
      flags.volume > 0 ? fmt::format("--preset {} --volume {}", flags.preset, flags.volume)
                       : fmt::format("--preset {}", flags.preset)));
  return config;
}

// --activations auto on `device`: bf16 on a GPU (mixed precision, as train_gpt2's; f32 on the
// simulated GPU, whose kernels are the CPU's), f32 on the CPU.
void ResolveActivations(const Flags& flags, const tessera::Device& device,
                        tessera::UNet3dConfig& config) {
  if (flags.activations == "auto" && !device.is_cpu()) {
    config.activations = tessera::GpuActivations();
  }
}

// A prediction's logits on the host as f32 (a bf16 model's are bf16).
std::vector<float> LogitsF32(const tessera::Tensor& logits) {
  std::vector<float> values(static_cast<size_t>(logits.numel()));
  if (logits.dtype() == tessera::DType::kBF16) {
    const auto* bits = static_cast<const uint16_t*>(logits.raw_data());
    for (size_t i = 0; i < values.size(); ++i) values[i] = tessera::Bf16ToFloat(bits[i]);
  } else {
    std::copy_n(logits.data<float>(), values.size(), values.begin());
  }
  return values;
}

// Where batches come from: generated volumes, or patches of NIfTI cases (the last case held out
// for the final evaluation when there are several).
struct Data {
  std::vector<tessera::VolumeCase> train;
  std::vector<tessera::VolumeCase> held_out;
};

Result<std::vector<tessera::Tensor>> ToTensors(const tessera::VolumeBatch& volumes) {
  const int64_t v = volumes.volume;
  TESSERA_ASSIGN_OR_RETURN(
      tessera::Tensor x,
      tessera::Tensor::FromVector(tessera::Shape{volumes.count, volumes.channels, v, v, v},
                                  volumes.volumes));
  TESSERA_ASSIGN_OR_RETURN(
      tessera::Tensor y,
      tessera::Tensor::FromVector(tessera::Shape{volumes.count, v, v, v}, volumes.labels));
  return std::vector<tessera::Tensor>{x, y};
}

// `batch` volumes of the generator's stream `seed`.
Result<std::vector<tessera::Tensor>> Batch(const tessera::UNet3dConfig& config, int64_t batch,
                                           uint64_t seed) {
  TESSERA_ASSIGN_OR_RETURN(
      tessera::VolumeBatch volumes,
      tessera::GenerateVolumes(batch, config.volume, config.in_channels, seed));
  return ToTensors(volumes);
}

// The batch of `step` (from 1): generated volumes, or the patches (step - 1) * batch on of the
// training cases.
Result<std::vector<tessera::Tensor>> StepBatch(const Flags& flags,
                                               const tessera::UNet3dConfig& config,
                                               const Data& data, int64_t step) {
  if (data.train.empty()) {
    return Batch(config, flags.batch, flags.seed * 1'000'003 + static_cast<uint64_t>(step));
  }
  TESSERA_ASSIGN_OR_RETURN(tessera::VolumeBatch patches,
                           tessera::SamplePatches(data.train, flags.batch, config.volume,
                                                  flags.seed, (step - 1) * flags.batch));
  return ToTensors(patches);
}

// The final evaluation's batch: volumes of another generator stream, or patches of the held-out
// case (of the training cases when there is only one).
Result<std::vector<tessera::Tensor>> HeldOutBatch(const Flags& flags,
                                                  const tessera::UNet3dConfig& config,
                                                  const Data& data) {
  if (data.train.empty()) return Batch(config, flags.batch, flags.seed * 7'777'777 + 1);
  TESSERA_ASSIGN_OR_RETURN(
      tessera::VolumeBatch patches,
      tessera::SamplePatches(data.held_out.empty() ? data.train : data.held_out, flags.batch,
                             config.volume, flags.seed * 7'777'777 + 1, 0));
  return ToTensors(patches);
}

Result<Data> LoadData(const Flags& flags, const tessera::UNet3dConfig& config) {
  Data data;
  if (flags.data_dir.empty()) return data;
  TESSERA_ASSIGN_OR_RETURN(
      data.train,
      tessera::LoadVolumeDataset(
          flags.data_dir,
          {.channels = config.in_channels,
           .classes = static_cast<int32_t>(config.classes),
           .max_bytes = static_cast<int64_t>(flags.data_memory_gib * double(int64_t{1} << 30))}));
  int64_t voxels = 0;
  for (const tessera::VolumeCase& c : data.train) voxels += c.width * c.height * c.depth;
  if (data.train.size() > 1) {
    data.held_out.push_back(std::move(data.train.back()));
    data.train.pop_back();
  }
  std::printf("data: %zu cases from %s (%lld voxels), patches of %lld^3 with random flips%s%s\n",
              data.train.size() + data.held_out.size(), flags.data_dir.c_str(),
              static_cast<long long>(voxels), static_cast<long long>(config.volume),
              data.held_out.empty() ? "; no case held out (only one)" : "; held out: ",
              data.held_out.empty() ? "" : data.held_out[0].name.c_str());
  return data;
}

// The volumes --predict segments whole: the held-out case (of the training cases when there is
// only one), or a generated volume twice the patch's size along each axis.
Result<std::vector<tessera::VolumeCase>> PredictionCases(const Flags& flags,
                                                         const tessera::UNet3dConfig& config,
                                                         const Data& data) {
  if (!data.train.empty()) return data.held_out.empty() ? data.train : data.held_out;
  TESSERA_ASSIGN_OR_RETURN(tessera::VolumeBatch generated,
                           tessera::GenerateVolumes(1, 2 * config.volume, config.in_channels,
                                                    flags.seed * 7'777'777 + 2));
  tessera::VolumeCase c;
  c.name = "generated";
  c.width = c.height = c.depth = generated.volume;
  c.channels = generated.channels;
  c.image = std::move(generated.volumes);
  c.labels = std::move(generated.labels);
  return std::vector<tessera::VolumeCase>{std::move(c)};
}

// --predict: each case segmented whole by sliding-window inference (data/sliding_window.h:
// patches of the trained size, half a patch apart, Gaussian-weighted), Dice per class printed and,
// with --predict-out, the label map written as NIfTI on the case's grid.
Status PredictWhole(const Flags& flags, const tessera::UNet3dConfig& config, const Data& data,
                    tessera::Trainer& trainer) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<tessera::VolumeCase> cases,
                           PredictionCases(flags, config, data));
  const int64_t v = config.volume, patch_voxels = v * v * v;
  for (const tessera::VolumeCase& c : cases) {
    const std::vector<tessera::PatchOrigin> tiles =
        tessera::SlidingWindowTiles(c.width, c.height, c.depth, v, std::max<int64_t>(1, v / 2));
    tessera::SlidingWindowPrediction prediction(c.width, c.height, c.depth, config.classes, v);
    std::vector<int32_t> unused_labels(static_cast<size_t>(patch_voxels));
    for (size_t first = 0; first < tiles.size(); first += static_cast<size_t>(flags.batch)) {
      const int64_t rows =
          std::min<int64_t>(flags.batch, static_cast<int64_t>(tiles.size() - first));
      std::vector<float> image(static_cast<size_t>(rows * c.channels * patch_voxels));
      for (int64_t r = 0; r < rows; ++r) {
        tessera::CropPatch(c, tiles[first + static_cast<size_t>(r)], v,
                           image.data() + r * c.channels * patch_voxels, unused_labels.data());
      }
      TESSERA_ASSIGN_OR_RETURN(
          tessera::Tensor x,
          tessera::Tensor::FromVector(tessera::Shape{rows, c.channels, v, v, v}, image));
      TESSERA_ASSIGN_OR_RETURN(tessera::Tensor logits, trainer.Predict({x, tessera::Tensor()}));
      const std::vector<float> values = LogitsF32(logits);
      for (int64_t r = 0; r < rows; ++r) {
        prediction.Add(tiles[first + static_cast<size_t>(r)],
                       values.data() + r * config.classes * patch_voxels);
      }
    }
    const std::vector<int32_t> predicted = prediction.Classes();
    TESSERA_ASSIGN_OR_RETURN(std::vector<double> dice,
                             tessera::DicePerClass(predicted, c.labels, config.classes));
    std::string per_class;
    double sum = 0;
    int scored = 0;
    for (size_t k = 0; k < dice.size(); ++k) {
      per_class += fmt::format(" {}={}", k + 1,
                               std::isnan(dice[k]) ? "n/a" : fmt::format("{:.4f}", dice[k]));
      if (!std::isnan(dice[k])) {
        sum += dice[k];
        ++scored;
      }
    }
    std::printf(
        "predict %s: %lld x %lld x %lld voxels in %zu patches of %lld^3; dice per class%s; "
        "mean %.4f\n",
        c.name.c_str(), static_cast<long long>(c.width), static_cast<long long>(c.height),
        static_cast<long long>(c.depth), tiles.size(), static_cast<long long>(v), per_class.c_str(),
        scored > 0 ? sum / scored : 0.0);
    if (!flags.predict_out.empty()) {
      std::error_code error;
      std::filesystem::create_directories(flags.predict_out, error);
      tessera::NiftiVolume out;
      out.width = c.width;
      out.height = c.height;
      out.depth = c.depth;
      out.spacing = c.spacing;
      out.affine = c.affine;
      out.stored = tessera::NiftiType::kUint8;
      out.voxels.assign(predicted.begin(), predicted.end());
      const std::string path = fmt::format("{}/{}.nii.gz", flags.predict_out, c.name);
      TESSERA_RETURN_IF_ERROR(tessera::WriteNifti(path, out));
      std::printf("wrote %s\n", path.c_str());
    }
  }
  return Status::Ok();
}

// --write-volumes DIR: `cases` generated volumes of the preset's size as a NIfTI dataset.
Status WriteVolumes(const Flags& flags) {
  TESSERA_ASSIGN_OR_RETURN(tessera::UNet3dConfig config, ModelConfig(flags));
  TESSERA_ASSIGN_OR_RETURN(
      tessera::VolumeBatch volumes,
      tessera::GenerateVolumes(flags.cases, config.volume, config.in_channels, flags.seed));
  TESSERA_RETURN_IF_ERROR(tessera::WriteVolumeDataset(flags.write_volumes, volumes));
  std::printf(
      "wrote %lld generated cases of %lld^3 voxels, %lld channel(s), to %s (nnU-Net's layout: "
      "imagesTr/, labelsTr/, dataset.json); train on them with: %s --data %s\n",
      static_cast<long long>(flags.cases), static_cast<long long>(config.volume),
      static_cast<long long>(config.in_channels), flags.write_volumes.c_str(), kProgram,
      flags.write_volumes.c_str());
  return Status::Ok();
}

// The batch's Dice score. The prediction runs on the training step's placement (in slabs under
// --spatial-parallel), so whatever trains also evaluates.
Result<float> Dice(tessera::Trainer& trainer, const std::vector<tessera::Tensor>& batch,
                   const tessera::UNet3dConfig& config) {
  TESSERA_ASSIGN_OR_RETURN(tessera::Tensor logits, trainer.Predict(batch));
  const int64_t voxels = config.volume * config.volume * config.volume;
  return tessera::cpu::DiceScore(LogitsF32(logits).data(), batch[1].data<int32_t>(),
                                 batch[1].shape()[0], config.classes, voxels);
}

// --spatial-parallel S: each volume's depth split into S slabs over groups of S of the
// data-parallel workers (the plan's sequence ranks, splitting volumes instead of sequences).
Status ApplySpatialParallel(const Flags& flags, tessera::TrainingPlan& plan) {
  const int slabs = flags.spatial_parallel;
  if (slabs == 1) return Status::Ok();
  tessera::ParallelConfig& p = plan.parallel;
  if (p.sequence_parallel > 1 || p.tensor_parallel > 1) {
    return tessera::InvalidArgument(
        "--spatial-parallel {} splits volumes into slabs; it does not combine with "
        "--sequence-parallel or --tensor-parallel: use one of them",
        slabs);
  }
  if (p.data_parallel % slabs != 0) {
    return tessera::InvalidArgument(
        "--spatial-parallel {} puts each slab of a volume on its own worker, but there are {} "
        "data-parallel worker(s): use --workers {} (or a multiple of {})",
        slabs, p.data_parallel, slabs, slabs);
  }
  p.sequence_parallel = slabs;
  p.sequence_attention = tessera::SequenceAttention::kHalo;
  return Status::Ok();
}

Result<tessera::TrainingPlan> MakePlan(const Flags& flags, const tessera::ModelSpec& model,
                                       const examples::Runtime& runtime) {
  tessera::TrainingPlan plan;
  plan.batch = flags.batch;
  plan.optimizer.weight_decay = 0.0;
  TESSERA_RETURN_IF_ERROR(examples::ApplyPlanFlags(flags.common, kProgram, plan));
  TESSERA_RETURN_IF_ERROR(ApplySpatialParallel(flags, plan));
  // --plan auto: --workers bounds the search, which fills in the ranks (a volume's batch of one
  // need not split over them); checked here as one row group.
  if (flags.common.search.plan == "auto") {
    plan.parallel.data_parallel = plan.parallel.sequence_parallel;
  }
  // --device cuda: the step on a GPU (this process's, or each worker's own), in bf16 activations
  // unless --activations f32 (ResolveActivations).
  if (!runtime.device.is_cpu()) plan.device = tessera::Device::Cuda(0);
  TESSERA_RETURN_IF_ERROR(examples::CheckFlagCombinations(flags.common));
  TESSERA_RETURN_IF_ERROR(plan.Validate(model));
  TESSERA_RETURN_IF_ERROR(
      examples::ApplyBalance(flags.common, model, runtime.executor, kProgram, plan));
  return plan;
}

// The loop's hooks: batches from the step number (so a resumed run continues the same stream),
// the step line with the batch's Dice.
examples::TrainingLoop::Hooks LoopHooks(const Flags& flags, const tessera::UNet3dConfig& config,
                                        examples::Prefetcher& prefetcher, int64_t first) {
  return {.batch = [&prefetcher](int64_t step) { return prefetcher.Get(step); },
          .log_step =
              [&flags, &config, first](tessera::Trainer& trainer, int64_t step,
                                       const tessera::StepReport& report,
                                       const std::vector<tessera::Tensor>& batch) {
                if (step % flags.common.log_every != 0 && step != flags.steps && step != first) {
                  return Status::Ok();
                }
                TESSERA_ASSIGN_OR_RETURN(const float dice, Dice(trainer, batch, config));
                std::printf("step %lld/%lld loss %.4f dice %.4f  %.1f ms\n",
                            static_cast<long long>(step), static_cast<long long>(flags.steps),
                            report.loss, dice, report.step_ms);
                std::fflush(stdout);
                return Status::Ok();
              }};
}

Status Train(const Flags& flags) {
  TESSERA_ASSIGN_OR_RETURN(tessera::UNet3dConfig config, ModelConfig(flags));
  TESSERA_ASSIGN_OR_RETURN(tessera::OpRegistry registry, tessera::MakeCpuOpRegistry());
  TESSERA_ASSIGN_OR_RETURN(const Data data, LoadData(flags, config));
  TESSERA_ASSIGN_OR_RETURN(examples::Runtime runtime, examples::OpenRuntime(flags.common));
  ResolveActivations(flags, runtime.device, config);
  TESSERA_ASSIGN_OR_RETURN(tessera::ModelSpec model, tessera::BuildUNet3d(config, registry));
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
  std::printf("U-Net 3D %s: %lld parameters, volumes %lld^3, batch %lld, %s activations, %s\n",
              config.ToString().c_str(), static_cast<long long>(model.NumParameters()),
              static_cast<long long>(config.volume), static_cast<long long>(flags.batch),
              std::string(tessera::DTypeName(config.activations)).c_str(),
              plan.parallel.ToString().c_str());
  if (std::string pipeline =
          examples::DescribePipeline(trainer->step_graph(), trainer->planned_model());
      !pipeline.empty()) {
    std::printf("pipeline %s\n", pipeline.c_str());
  }
  // Under --spatial-parallel S: how the volumes split and what crosses between slabs.
  if (std::string slabs =
          examples::DescribeSequenceParallel(trainer->step_graph(), trainer->planned_model());
      !slabs.empty()) {
    std::printf("spatial parallel: %s\n", slabs.c_str());
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
  examples::Prefetcher prefetcher(
      [&flags, &config, &data](int64_t step) { return StepBatch(flags, config, data, step); },
      flags.steps);
  examples::TrainingLoop loop({.program = kProgram,
                               .job = kProgram,
                               .steps = flags.steps,
                               .lr = static_cast<float>(flags.lr),
                               .items_per_step = static_cast<double>(flags.batch),
                               .items_are_tokens = false},
                              LoopHooks(flags, config, prefetcher, first), checkpoints, nullptr,
                              *session);
  TESSERA_RETURN_IF_ERROR(loop.Run(trainer, first));
  TESSERA_RETURN_IF_ERROR(checkpoints.SaveAtEnd(*trainer, flags.steps, ""));
  // Held out: volumes from another stream of the generator, or patches of the held-out case.
  TESSERA_ASSIGN_OR_RETURN(std::vector<tessera::Tensor> held_out,
                           HeldOutBatch(flags, config, data));
  TESSERA_ASSIGN_OR_RETURN(const float loss, trainer->EvalLoss(held_out));
  TESSERA_ASSIGN_OR_RETURN(const float dice, Dice(*trainer, held_out, config));
  std::printf("held-out: loss %.4f dice %.4f\n", loss, dice);
  if (flags.predict) TESSERA_RETURN_IF_ERROR(PredictWhole(flags, config, data, *trainer));
  TESSERA_RETURN_IF_ERROR(examples::WriteStepTrace(*trainer, flags.common.trace, kProgram));
  loop.stats().PrintRanks();
  checkpoints.PrintSummary();
  std::printf("%s\n", prefetcher.Summary().c_str());
  loop.stats().PrintSummary(flags.steps, "samples_per_s", static_cast<double>(flags.batch));
  return Status::Ok();
}

// The program. main() reports an exception that escapes it (memory running out, a bug) as an
// error instead of terminating.
int Main(int argc, char** argv) {
  Flags flags;
  CLI::App app{
      "Train a 3D U-Net on generated segmentation volumes (spheres and boxes) or on NIfTI volumes "
      "(--data)"};
  app.add_option("--preset", flags.preset,
                 "Model preset: tiny, small, or nnunet (nnU-Net's 3d_fullres shape: 6 stages of "
                 "32-320 channels, instance norm, leaky ReLU, strided convolutions; 31 M "
                 "parameters, 128^3 patches)");
  app.add_option("--volume", flags.volume,
                 "The patch's edge in voxels (a multiple of 2^depth; 0: the preset's)")
      ->check(tessera::AtLeast(0));
  app.add_flag("--deep-supervision", flags.deep_supervision,
               "nnU-Net's deep supervision: heads at decoder levels 1 to depth - 2 as well, each "
               "level's cross-entropy against the labels sampled down to it, weighted 2^-level "
               "(normalised); the loss printed is that sum (needs depth >= 3: --preset nnunet)");
  app.add_option("--activations", flags.activations,
                 "The activations' type: f32, bf16 (mixed precision: parameters, gradients, "
                 "norm statistics and the loss stay f32; on the CPU computed in f32 and rounded "
                 "as the GPU's kernels round, a reference for them), or auto: bf16 on a GPU, f32 "
                 "on the CPU")
      ->check(CLI::IsMember({"auto", "f32", "bf16"}));
  app.add_option("--spatial-parallel", flags.spatial_parallel,
                 "S: each volume split into S slabs of its depth, one on each of S workers "
                 "(--workers a multiple of S), for volumes beyond one worker: convolutions read "
                 "their neighbours' boundary planes (halos), norms every slab's statistics; the "
                 "volume's depth / 2^depth must be a multiple of S (CPU workers)")
      ->check(tessera::AtLeast(1));
  app.add_option("--steps", flags.steps, "Training steps")->check(tessera::AtLeast(0));
  app.add_option("--batch", flags.batch, "Volumes per step")->check(tessera::AtLeast(1));
  app.add_option("--lr", flags.lr, "Learning rate (AdamW, constant)")->check(tessera::AboveZero());
  app.add_option("--seed", flags.seed, "Seed for initialisation and data");
  app.add_option("--data", flags.data_dir,
                 "NIfTI volumes to train on: DIR/imagesTr and DIR/labelsTr as nnU-Net or the "
                 "Medical Segmentation Decathlon lay them out (default: generated volumes)");
  app.add_option("--data-memory-gib", flags.data_memory_gib,
                 "With --data: the most memory the loaded volumes may take")
      ->check(tessera::AboveZero());
  app.add_flag("--predict", flags.predict,
               "After training, segment whole volumes by sliding-window inference (the held-out "
               "case with --data, else a generated volume twice the patch's size) and print Dice "
               "per class");
  app.add_option("--predict-out", flags.predict_out,
                 "With --predict: write the predicted label maps as NIfTI files in this folder");
  app.add_option("--write-volumes", flags.write_volumes,
                 "Write --cases generated volumes as a NIfTI dataset in this folder and exit");
  app.add_option("--cases", flags.cases, "With --write-volumes: how many")
      ->check(tessera::AtLeast(1));
  examples::AddThreadsFlag(app, flags.common);
  examples::AddDeviceFlags(app, flags.common);
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
  if (!flags.write_volumes.empty() && !flags.data_dir.empty()) {
    std::fprintf(stderr, "%s: --write-volumes writes a dataset and exits; run --data on it next\n",
                 kProgram);
    return 2;
  }
  if (Status status = flags.write_volumes.empty() ? Train(flags) : WriteVolumes(flags);
      !status.ok()) {
    std::fprintf(stderr, "%s: %s\n", kProgram, status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::RunMain(kProgram, [&] { return Main(argc, argv); });
}
