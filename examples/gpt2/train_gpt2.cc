// train_gpt2: trains a GPT-2 model with Tessera and prints its progress.
//
//   build/bin/train_gpt2                          # tiny model on the bundled Shakespeare text
//   build/bin/train_gpt2 --preset small --steps 500 --eval-every 100 --sample 300
//   build/bin/train_gpt2 --data train.bin --preset gpt2-124m --seq-len 64 --batch 4
//   build/bin/train_gpt2 --data nanogpt/train.bin --data-format uint16 --preset gpt2-124m
//   build/bin/train_gpt2 --init-from gpt2_124M.bin --steps 20 --export tuned.bin   # llm.c files
//   build/bin/train_gpt2 --layer-impl primitive   # the layers as programs of primitive ops
//
// Every step prints "step i/N loss X  T ms  K tok/s"; the run ends with one summary line
//   summary: steps=N step_ms_median=X tokens_per_s=Y final_loss=Z peak_mb=M [gpu_peak_mb=G]
//            steps_s=S
// (tokens_per_s: at the median step; peak_mb: the largest host-memory peak of the executor of
// any process that ran steps; gpu_peak_mb, with --device cuda in this process: the largest
// GPU-memory peak of a step; steps_s: every step's time together, the run end to end.)
// Diagnostics go to stderr, so stdout stays easy to parse. The flags every example shares (the
// plan, devices, checkpoints, recovery, traces) and the loop are examples/common's.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/allocator.h"
#include "core/flag_checks.h"
#include "core/run_main.h"
#include "examples/common/flags.h"
#include "examples/common/session.h"
#include "examples/common/training_loop.h"
#include "model/gpt2.h"
#include "model/gpt2_llmc.h"
#include "training/token_dataset.h"
#include "training/trainer.h"
#include "worker/gpu.h"

namespace {

using tessera::Gpt2Config;
using tessera::Result;
using tessera::Status;
using tessera::Trainer;
namespace examples = tessera::examples;

constexpr const char* kProgram = "train_gpt2";
// More blocks than any GPT has had (GPT-3 has 96): beyond it, building the model and planning
// its step take minutes before anything is printed, for a model nobody means to train.
constexpr int64_t kMaxLayers = 1024;

#ifndef TESSERA_DEFAULT_DATA
#define TESSERA_DEFAULT_DATA "data/tinyshakespeare.txt"
#endif

struct Flags {
  std::string preset = "tiny";
  int64_t layers = 0, channels = 0, heads = 0, vocab = 0, seq_len = 0, batch = 0;
  int64_t max_seq_len = 0;
  std::string layer_impl = "fused";
  int64_t steps = 200;
  double lr = 1e-3;
  double weight_decay = 0.1;
  double grad_clip = 1.0;
  std::string optimizer = "adamw";
  int freeze_step = 100;  // --optimizer onebit-adam: warm-up steps
  // --optimizer zero-one-adam (DeepSpeed's defaults but var_freeze_step, theirs 100000)
  int var_freeze_step = 100;
  int var_update_scaler = 16;
  int local_step_scaler = 32678;
  int local_step_clipper = 16;
  uint64_t seed = 1337;
  std::string data = TESSERA_DEFAULT_DATA;
  std::string data_format = "auto";
  double val_fraction = 0.1;
  int64_t eval_every = 0;
  int64_t eval_batches = 8;
  int64_t sample = 0;
  double temperature = 1.0;
  std::string prompt = "\n";
  std::string init_from;      // an llm.c GPT-2 checkpoint: the model and its parameters
  std::string export_path;    // where to write the trained parameters in llm.c's format
  bool preset_given = false;  // --preset on the command line (not the default)
  examples::CommonFlags common;
};

// ---- the model's shape ----

struct ResolvedShape {
  Gpt2Config config;
  int64_t batch = 0;
  int64_t seq_len = 0;
};

// --init-from: the model is the one in the file; model flags may repeat it but not change it.
Status CheckFlagsRepeatFile(const Flags& flags, const Gpt2Config& config) {
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
  if (!flags.preset_given) return Status::Ok();
  TESSERA_ASSIGN_OR_RETURN(Gpt2Config preset, Gpt2Config::Preset(flags.preset));
  if (preset != config) {
    return tessera::InvalidArgument(
        "--preset {} ({}) conflicts with --init-from '{}', which holds a model with {}: the "
        "model's shape comes from the file, drop --preset",
        flags.preset, preset.ToString(), flags.init_from, config.ToString());
  }
  return Status::Ok();
}

Result<ResolvedShape> ResolveShapeFromFile(const Flags& flags) {
  ResolvedShape shape;
  TESSERA_ASSIGN_OR_RETURN(shape.config, tessera::ReadLlmcConfig(flags.init_from));
  TESSERA_RETURN_IF_ERROR(CheckFlagsRepeatFile(flags, shape.config));
  // The presets' defaults: a GPT-2 124M-sized model trains on a CPU-sized context.
  const bool big = shape.config.NumParameters() > 50'000'000;
  shape.batch = flags.batch ? flags.batch : (big ? 4 : 8);
  shape.seq_len = flags.seq_len ? flags.seq_len : (big ? 64 : shape.config.max_seq_len);
  if (shape.seq_len > shape.config.max_seq_len) {
    return tessera::InvalidArgument("--seq-len {} exceeds the {} positions of the model in '{}'",
                                    shape.seq_len, shape.config.max_seq_len, flags.init_from);
  }
  return shape;
}

// Preset values, overridden by any dimension flag given explicitly.
Result<ResolvedShape> ResolveShape(const Flags& flags) {
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

// The driver's own share of a step: the batch's token ids and targets (and, with --data
// synthetic, a dataset of 16 batches) are built in this process, so they must fit in this
// machine's memory. Checked in floating point, before any size is computed in int64_t (an absurd
// --batch would overflow it); what the step needs besides is Trainer::Create's to check.
Status CheckBatchFits(const Flags& flags, const ResolvedShape& shape) {
  const int64_t memory = tessera::PhysicalHostMemoryBytes();
  const double copies = flags.data == "synthetic" ? 16 : 2;
  const double bytes = static_cast<double>(shape.batch) * static_cast<double>(shape.seq_len + 1) *
                       sizeof(int32_t) * copies;
  if (memory <= 0 || bytes <= static_cast<double>(memory)) return Status::Ok();
  return tessera::ResourceExhausted(
      "--batch {} x --seq-len {} needs {:.1f} GiB for the batches' token ids alone, more than this "
      "machine's {:.1f} GiB of memory: lower the batch (--batch) or the sequence length "
      "(--seq-len)",
      shape.batch, shape.seq_len, bytes / (1 << 30), static_cast<double>(memory) / (1 << 30));
}

// ---- data ----

// The dataset, its training and validation parts, and their samplers (which point into them:
// Data stays where LoadData made it).
struct Data {
  tessera::TokenDataset dataset, train_part, val_part;
  // Set by LoadData (the validation sampler only with --eval-every); read through train() and
  // val(), which abort on a broken promise.
  std::optional<tessera::BatchSampler> train_sampler, val_sampler;

  tessera::BatchSampler& train() {
    TESSERA_CHECK(train_sampler.has_value(), "no training sampler");
    return *train_sampler;
  }
  // REQUIRES: --eval-every > 0.
  tessera::BatchSampler& val() {
    TESSERA_CHECK(val_sampler.has_value(), "no validation sampler (--eval-every is 0)");
    return *val_sampler;
  }
};

Result<std::unique_ptr<Data>> LoadData(const Flags& flags, const ResolvedShape& shape) {
  const int64_t vocab = shape.config.vocab;
  TESSERA_ASSIGN_OR_RETURN(tessera::DataFormat format, tessera::ParseDataFormat(flags.data_format));
  TESSERA_ASSIGN_OR_RETURN(
      tessera::TokenDataset dataset,
      flags.data == "synthetic"
          ? Result<tessera::TokenDataset>(tessera::TokenDataset::Synthetic(
                std::max<int64_t>(1 << 20, 16 * shape.batch * (shape.seq_len + 1)),
                static_cast<int32_t>(vocab), flags.seed))
          : tessera::TokenDataset::Load(flags.data, format));
  if (dataset.max_token() >= vocab) {
    return tessera::InvalidArgument(
        "data '{}' has token id {} but the vocabulary is {}; use --vocab {} or more",
        dataset.source(), dataset.max_token(), vocab, dataset.max_token() + 1);
  }
  auto [train, val] = dataset.Split(flags.eval_every > 0 ? flags.val_fraction : 0.0);
  auto data = std::make_unique<Data>(
      Data{std::move(dataset), std::move(train), std::move(val), std::nullopt, std::nullopt});
  TESSERA_ASSIGN_OR_RETURN(
      data->train_sampler,
      tessera::BatchSampler::Create(data->train_part, shape.batch, shape.seq_len, flags.seed));
  if (flags.eval_every > 0) {
    TESSERA_ASSIGN_OR_RETURN(
        data->val_sampler,
        tessera::BatchSampler::Create(data->val_part, shape.batch, shape.seq_len, flags.seed));
  }
  return data;
}

// ---- the plan ----

Result<tessera::TrainingPlan> MakePlan(const Flags& flags, const ResolvedShape& shape,
                                       const examples::Runtime& runtime,
                                       const tessera::ModelSpec& model) {
  tessera::TrainingPlan plan;
  if (!runtime.device.is_cpu()) plan.device = tessera::Device::Cuda(0);  // the worker's own GPU
  plan.batch = shape.batch;
  plan.seq_len = shape.seq_len;
  plan.optimizer.weight_decay = flags.weight_decay;
  plan.optimizer.max_grad_norm = flags.grad_clip;
  if (flags.optimizer == "sgd") plan.optimizer.kind = tessera::OptimizerConfig::Kind::kSgd;
  if (flags.optimizer == "onebit-adam") {
    plan.optimizer.kind = tessera::OptimizerConfig::Kind::kOneBitAdam;
    plan.optimizer.freeze_step = flags.freeze_step;
  }
  if (flags.optimizer == "zero-one-adam") {
    plan.optimizer.kind = tessera::OptimizerConfig::Kind::kZeroOneAdam;
    plan.optimizer.var_freeze_step = flags.var_freeze_step;
    plan.optimizer.var_update_scaler = flags.var_update_scaler;
    plan.optimizer.local_step_scaler = flags.local_step_scaler;
    plan.optimizer.local_step_clipper = flags.local_step_clipper;
  }
  TESSERA_RETURN_IF_ERROR(examples::ApplyPlanFlags(flags.common, kProgram, plan));
  if (flags.common.checkpoints.resume && !flags.init_from.empty()) {
    return tessera::InvalidArgument(
        "--init-from and --resume both say where training starts: use one of them");
  }
  TESSERA_RETURN_IF_ERROR(examples::CheckFlagCombinations(flags.common));
  TESSERA_RETURN_IF_ERROR(plan.Validate(model));  // refused before any process starts
  TESSERA_RETURN_IF_ERROR(
      examples::ApplyBalance(flags.common, model, runtime.executor, kProgram, plan));
  return plan;
}

// ---- llm.c files ----

tessera::Gpt2ParameterGroups GroupsOf(Trainer& trainer) {
  return {.read =
              [&trainer](size_t layer) {
                return trainer.ReadGroup(layer, tessera::StateKind::kParameter);
              },
          .write =
              [&trainer](size_t layer, std::span<const float> values) {
                // Padded as the plan pads the group (ZeRO shards).
                std::vector<float> group(
                    static_cast<size_t>(trainer.step_graph().group_numel[layer]), 0.0f);
                std::copy(values.begin(), values.end(), group.begin());
                return trainer.WriteGroup(layer, tessera::StateKind::kParameter, group);
              }};
}

// ---- sampling ----

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

Result<std::vector<int32_t>> Sample(Trainer& trainer, const Gpt2Config& config,
                                    std::vector<int32_t> context, int64_t count, int64_t seq_len,
                                    double temperature, uint64_t seed) {
  const int64_t vocab = config.vocab;
  std::mt19937_64 rng(seed);
  std::vector<int32_t> generated;
  std::vector<int32_t> window(static_cast<size_t>(seq_len));
  for (int64_t i = 0; i < count; ++i) {
    // The last seq_len tokens, left-aligned and zero-padded: causal attention makes the padding
    // invisible to the position we read.
    const int64_t used = std::min<int64_t>(static_cast<int64_t>(context.size()), seq_len);
    std::fill(window.begin(), window.end(), 0);
    std::copy(context.end() - used, context.end(), window.begin());
    TESSERA_ASSIGN_OR_RETURN(std::vector<tessera::Tensor> prompt,
                             tessera::Gpt2Prompt(config, window, 1, seq_len));
    TESSERA_ASSIGN_OR_RETURN(tessera::Tensor logits, trainer.Predict(prompt));
    const float* row = logits.data<float>() + (used - 1) * vocab;
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

// --sample N: N tokens after --prompt, printed as "sample:\n<prompt><tokens>".
Status PrintSample(Trainer& trainer, const Flags& flags, const ResolvedShape& shape,
                   const Data& data) {
  std::vector<int32_t> context;
  for (unsigned char c : flags.prompt) context.push_back(c);
  if (!data.dataset.is_text() || context.empty()) context = {0};
  for (int32_t& token : context) {
    token = std::min<int32_t>(token, static_cast<int32_t>(shape.config.vocab - 1));
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<int32_t> sample,
                           Sample(trainer, shape.config, context, flags.sample, shape.seq_len,
                                  flags.temperature, flags.seed + 1));
  std::printf("sample:\n%s%s\n", Printable(context, data.dataset.is_text()).c_str(),
              Printable(sample, data.dataset.is_text() && shape.config.vocab <= 256).c_str());
  return Status::Ok();
}

// ---- the run ----

// A trainer on the session's backend, its parameters from --seed or --init-from, its first lines
// printed.
Result<std::unique_ptr<Trainer>> MakeTrainer(const Flags& flags, const ResolvedShape& shape,
                                             const tessera::ModelSpec& model,
                                             const tessera::TrainingPlan& plan,
                                             examples::Session& session, const Data& data) {
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<tessera::GraphBackend> backend, session.MakeBackend());
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                           Trainer::Create(model, plan, std::move(backend)));
  TESSERA_RETURN_IF_ERROR(trainer->InitializeParameters(flags.seed));
  if (!flags.init_from.empty()) {
    TESSERA_RETURN_IF_ERROR(tessera::ImportLlmc(shape.config, GroupsOf(*trainer), flags.init_from));
    std::fprintf(stderr, "%s: parameters from %s (llm.c checkpoint)\n", kProgram,
                 flags.init_from.c_str());
  }
  std::fprintf(
      stderr, "%s: %s, %lld parameters, batch %lld x %lld tokens, %s, data %s (%lld tokens)\n",
      kProgram, shape.config.ToString().c_str(),
      static_cast<long long>(shape.config.NumParameters()), static_cast<long long>(shape.batch),
      static_cast<long long>(shape.seq_len), trainer->backend().Describe().c_str(),
      data.dataset.source().c_str(), static_cast<long long>(data.dataset.size()));
  std::fprintf(stderr, "%s: plan %s, micro-batch %lld\n", kProgram,
               trainer->plan().parallel.ToString().c_str(),
               static_cast<long long>(trainer->step_graph().micro_batch_rows));
  if (std::string pipeline =
          examples::DescribePipeline(trainer->step_graph(), trainer->planned_model());
      !pipeline.empty()) {
    std::fprintf(stderr, "%s: pipeline %s\n", kProgram, pipeline.c_str());
  }
  if (std::string tensor =
          examples::DescribeTensorParallel(trainer->step_graph(), trainer->planned_model());
      !tensor.empty()) {
    std::fprintf(stderr, "%s: %s\n", kProgram, tensor.c_str());
    const int64_t ranks = trainer->plan().parallel.tensor_parallel;
    const int64_t vocab = shape.config.vocab;
    const int64_t splitting = (vocab + ranks - 1) / ranks * ranks;
    if (vocab % ranks != 0) {
      std::fprintf(stderr,
                   "%s: the vocabulary (%lld) is not a multiple of %lld tensor ranks, so the "
                   "embedding and classifier are replicated on every rank; --vocab %lld would "
                   "split them\n",
                   kProgram, static_cast<long long>(vocab), static_cast<long long>(ranks),
                   static_cast<long long>(splitting));
    }
  }
  if (std::string sequence =
          examples::DescribeSequenceParallel(trainer->step_graph(), trainer->planned_model());
      !sequence.empty()) {
    std::fprintf(stderr, "%s: %s\n", kProgram, sequence.c_str());
  }
  if (std::string buckets = examples::DescribeBuckets(trainer->step_graph()); !buckets.empty()) {
    std::fprintf(stderr, "%s: gradient buckets %s\n", kProgram, buckets.c_str());
  }
  return trainer;
}

// The validation loss over --eval-batches sequential batches: "eval step i: val_loss X".
Result<double> Evaluate(Trainer& trainer, const Flags& flags, const ResolvedShape& shape,
                        Data& data, int64_t step) {
  std::vector<int32_t> tokens(static_cast<size_t>(shape.batch * shape.seq_len));
  std::vector<int32_t> targets(tokens.size());
  double total = 0;
  for (int64_t b = 0; b < flags.eval_batches; ++b) {
    data.val().Sequential(b, tokens.data(), targets.data());
    TESSERA_ASSIGN_OR_RETURN(
        std::vector<tessera::Tensor> batch,
        tessera::Gpt2Batch(shape.config, tokens, targets, shape.batch, shape.seq_len));
    TESSERA_ASSIGN_OR_RETURN(float loss, trainer.EvalLoss(batch));
    total += loss;
  }
  const double validation_loss = total / static_cast<double>(flags.eval_batches);
  std::printf("eval step %lld: val_loss %.4f\n", static_cast<long long>(step), validation_loss);
  std::fflush(stdout);
  return validation_loss;
}

// The loop's hooks: batches from the training sampler, GPT-2's step line, evaluation.
examples::TrainingLoop::Hooks LoopHooks(const Flags& flags, const ResolvedShape& shape,
                                        Data& data) {
  const double tokens = static_cast<double>(shape.batch * shape.seq_len);
  return {.batch = [&shape, &data](int64_t) -> Result<std::vector<tessera::Tensor>> {
            std::vector<int32_t> x(static_cast<size_t>(shape.batch * shape.seq_len)), y(x.size());
            data.train().Next(x.data(), y.data());
            return tessera::Gpt2Batch(shape.config, x, y, shape.batch, shape.seq_len);
          },
          .data_state = [&data] { return data.train().SaveState(); },
          .restore_data_state =
              [&data](const std::string& state) { return data.train().RestoreState(state); },
          .log_step =
              [&flags, tokens](Trainer&, int64_t i, const tessera::StepReport& report,
                               const std::vector<tessera::Tensor>&) {
                const int64_t steps = flags.steps;
                if (i % flags.common.log_every == 0 || i == steps || i == 1) {
                  std::printf("step %lld/%lld loss %.4f  %.1f ms  %.0f tok/s\n",
                              static_cast<long long>(i), static_cast<long long>(steps), report.loss,
                              report.step_ms, tokens / (report.step_ms / 1000.0));
                  std::fflush(stdout);
                }
                return Status::Ok();
              },
          .after_step = [&flags, &shape, &data](Trainer& trainer, int64_t i) -> Result<double> {
            if (flags.eval_every <= 0 || (i % flags.eval_every != 0 && i != flags.steps)) {
              return std::numeric_limits<double>::quiet_NaN();
            }
            return Evaluate(trainer, flags, shape, data, i);
          }};
}

// After the steps: the sample, the last checkpoint, the llm.c export, the trace.
Status Finish(Trainer& trainer, const Flags& flags, const ResolvedShape& shape, Data& data,
              examples::Checkpoints& checkpoints) {
  if (flags.sample > 0) TESSERA_RETURN_IF_ERROR(PrintSample(trainer, flags, shape, data));
  TESSERA_RETURN_IF_ERROR(checkpoints.SaveAtEnd(trainer, flags.steps, data.train().SaveState()));
  if (!flags.export_path.empty()) {
    TESSERA_RETURN_IF_ERROR(tessera::ExportLlmc(shape.config, GroupsOf(trainer), flags.export_path)
                                .WithContext("--export"));
    std::fprintf(stderr, "%s: parameters after step %lld exported to %s (llm.c format)\n", kProgram,
                 static_cast<long long>(trainer.steps_taken()), flags.export_path.c_str());
  }
  return examples::WriteStepTrace(trainer, flags.common.trace, kProgram);
}

Status Train(const Flags& flags) {
  TESSERA_ASSIGN_OR_RETURN(ResolvedShape shape, ResolveShape(flags));
  TESSERA_RETURN_IF_ERROR(CheckBatchFits(flags, shape));
  TESSERA_ASSIGN_OR_RETURN(examples::Runtime runtime, examples::OpenRuntime(flags.common));
  if (!runtime.device.is_cpu()) shape.config.activations = tessera::GpuActivations();
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Data> data, LoadData(flags, shape));
  TESSERA_ASSIGN_OR_RETURN(tessera::Gpt2LayerImpl layers,
                           tessera::ParseGpt2LayerImpl(flags.layer_impl));
  TESSERA_ASSIGN_OR_RETURN(tessera::ModelSpec model, tessera::BuildGpt2(shape.config, layers));
  TESSERA_ASSIGN_OR_RETURN(tessera::TrainingPlan plan, MakePlan(flags, shape, runtime, model));
  // Where the step runs: this process, a local cluster we start, or a running cluster.
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<examples::Session> session,
                           examples::Session::Open(flags.common, runtime, kProgram));
  TESSERA_RETURN_IF_ERROR(
      examples::UseTheClustersWorkers(flags.common, *session, model, runtime, kProgram, plan));
  TESSERA_RETURN_IF_ERROR(
      examples::ChooseThePlan(flags.common, *session, model, runtime, kProgram, plan));
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                           MakeTrainer(flags, shape, model, plan, *session, *data));
  TESSERA_RETURN_IF_ERROR(examples::PrintMemoryPlan(*trainer, flags.common.trace));
  examples::Checkpoints checkpoints(flags.common.checkpoints, kProgram);
  TESSERA_ASSIGN_OR_RETURN(std::optional<tessera::CheckpointInfo> resumed,
                           checkpoints.Resume(*trainer));
  if (resumed) {
    TESSERA_RETURN_IF_ERROR(
        data->train().RestoreState(resumed->sampler_state).WithContext(resumed->path));
  }
  // Recovery from lost workers (training/recovery.h): back to the last checkpoint, so there is
  // one from the start.
  std::unique_ptr<tessera::StepRecovery> recovery =
      examples::MakeRecovery(flags.common, *session, runtime.settings, model, plan);
  if (recovery && !resumed) {
    TESSERA_RETURN_IF_ERROR(checkpoints.Save(*trainer, data->train().SaveState()));
  }
  if (recovery) recovery->AfterStep(*trainer, data->train().SaveState(), /*checkpointed=*/true);
  // A model that did not start from scratch: how good it is before training.
  if (!flags.init_from.empty() && flags.eval_every > 0) {
    TESSERA_RETURN_IF_ERROR(Evaluate(*trainer, flags, shape, *data, 0).status());
  }
  examples::TrainingLoop loop({.program = kProgram,
                               .job = kProgram,
                               .steps = flags.steps,
                               .lr = static_cast<float>(flags.lr),
                               .items_per_step = static_cast<double>(shape.batch * shape.seq_len)},
                              LoopHooks(flags, shape, *data), checkpoints, recovery.get(),
                              *session);
  TESSERA_RETURN_IF_ERROR(loop.Run(trainer, resumed ? resumed->step + 1 : 1));
  TESSERA_RETURN_IF_ERROR(Finish(*trainer, flags, shape, *data, checkpoints));
  loop.stats().PrintRanks();
  checkpoints.PrintSummary();
  if (recovery && recovery->snapshot_stats().taken > 0) {
    const tessera::StepRecovery::SnapshotStats& snapshots = recovery->snapshot_stats();
    std::printf("peer snapshots: %d taken, %.1f ms each on average, %.2f MB held on the workers\n",
                snapshots.taken, 1000.0 * snapshots.seconds / snapshots.taken,
                static_cast<double>(snapshots.bytes) / (1024.0 * 1024.0));
  }
  loop.stats().PrintSummary(flags.steps, "tokens_per_s",
                            static_cast<double>(shape.batch * shape.seq_len));
  return Status::Ok();
}

// ---- flags ----

// The model, training, data, evaluation and sampling flags, and the llm.c files.
void AddModelFlags(CLI::App& app, Flags& flags) {
  app.add_option("--layers", flags.layers, "Transformer blocks (overrides the preset)")
      ->check(tessera::Between(1, kMaxLayers));
  app.add_option("--channels", flags.channels, "Embedding width")->check(tessera::AtLeast(1));
  app.add_option("--heads", flags.heads, "Attention heads (must divide --channels)")
      ->check(tessera::AtLeast(1));
  app.add_option("--vocab", flags.vocab, "Vocabulary size (>= 256 for byte-level text)")
      ->check(tessera::AtLeast(1));
  app.add_option("--seq-len", flags.seq_len, "Tokens per sequence")->check(tessera::AtLeast(1));
  app.add_option("--max-seq-len", flags.max_seq_len,
                 "Positions in the position embedding (default: the preset's or --seq-len)")
      ->check(tessera::AtLeast(1));
  app.add_option("--layer-impl", flags.layer_impl,
                 "How the layers run: fused (hand-fused layer ops, the fast path) or primitive "
                 "(programs of primitive ops with derived backwards, the reference; CPU only). "
                 "Under --tensor-parallel and --sequence-parallel each rank runs the primitive "
                 "layers' split either way")
      ->check(CLI::IsMember({"fused", "primitive"}));
  app.add_option("--batch", flags.batch, "Sequences per step")->check(tessera::AtLeast(1));
  app.add_option("--steps", flags.steps, "Training steps")->check(tessera::AtLeast(0));
  app.add_option("--lr", flags.lr, "Learning rate (constant)")->check(tessera::AboveZero());
  app.add_option("--weight-decay", flags.weight_decay, "AdamW weight decay on matrices")
      ->check(tessera::AtLeast(0));
  app.add_option("--grad-clip", flags.grad_clip, "Global gradient-norm bound (0: off)")
      ->check(tessera::AtLeast(0));
  app.add_option("--optimizer", flags.optimizer,
                 "adamw, sgd, onebit-adam (1-bit Adam: --freeze-step steps of Adam without "
                 "bias correction, then the variance frozen and each worker's momentum averaged "
                 "by an error-feedback compressed all-reduce, 1/32 of the bytes) or "
                 "zero-one-adam (0/1 Adam: the variance updated at exponentially spaced steps "
                 "until --var-freeze-step, the gradients of the other steps averaged compressed; "
                 "then local steps, the workers synchronised compressed every 1 to "
                 "--local-step-clipper steps)")
      ->check(CLI::IsMember({"adamw", "sgd", "onebit-adam", "zero-one-adam"}));
  app.add_option("--freeze-step", flags.freeze_step,
                 "--optimizer onebit-adam: warm-up steps before the compressed phase")
      ->check(tessera::AtLeast(1));
  app.add_option("--var-freeze-step", flags.var_freeze_step,
                 "--optimizer zero-one-adam: the last step that may update the variance (e.g. "
                 "the end of a learning-rate warm-up)")
      ->check(tessera::AtLeast(1));
  app.add_option("--var-update-scaler", flags.var_update_scaler,
                 "--optimizer zero-one-adam: variance updates between doublings of their "
                 "interval (the paper's kappa)")
      ->check(tessera::AtLeast(1));
  app.add_option("--local-step-scaler", flags.local_step_scaler,
                 "--optimizer zero-one-adam: steps past --var-freeze-step between doublings of "
                 "the local-step interval")
      ->check(tessera::AtLeast(1));
  app.add_option("--local-step-clipper", flags.local_step_clipper,
                 "--optimizer zero-one-adam: the largest local-step interval (the paper's H; 1: "
                 "synchronise every step)")
      ->check(tessera::AtLeast(1));
  app.add_option("--seed", flags.seed, "Seed for initialisation, batches and sampling");
}

void AddDataFlags(CLI::App& app, Flags& flags) {
  app.add_option("--data", flags.data,
                 "Text file (tokenized as bytes), llm.c .bin token file, or 'synthetic'");
  app.add_option("--data-format", flags.data_format,
                 "How --data is read: auto (an llm.c .bin by its header, else text if it looks "
                 "like text, else refused), text (every byte a token), llmc (llm.c's .bin), "
                 "uint16 (raw little-endian uint16 tokens, no header: nanoGPT's train.bin)")
      ->check(CLI::IsMember({"auto", "text", "llmc", "uint16"}));
  app.add_option("--val-fraction", flags.val_fraction,
                 "Share of the data held out for --eval-every")
      ->check(CLI::Range(0.0, 0.5));
  app.add_option("--eval-every", flags.eval_every, "Validation loss every N steps (0: never)")
      ->check(tessera::AtLeast(0));
  app.add_option("--eval-batches", flags.eval_batches, "Batches per validation")
      ->check(tessera::AtLeast(1));
  app.add_option("--sample", flags.sample, "Generate N tokens after training")
      ->check(tessera::AtLeast(0));
  app.add_option("--temperature", flags.temperature, "Sampling temperature")
      ->check(tessera::AboveZero());
  app.add_option("--prompt", flags.prompt, "Text that starts the sample");
}

void AddLlmcFlags(CLI::App& app, Flags& flags) {
  app.add_option("--init-from", flags.init_from,
                 "Start from the parameters of an llm.c fp32 GPT-2 checkpoint (gpt2_124M.bin's "
                 "format); the model's shape comes from its header (model flags may only repeat "
                 "it), the optimizer state starts fresh");
  app.add_option("--export", flags.export_path,
                 "After training, write the parameters to this file in llm.c's fp32 GPT-2 "
                 "checkpoint format (for llm.c or --init-from)");
}

// The program. main() reports an exception that escapes it (memory running out, a bug) as an
// error instead of terminating.
int Main(int argc, char** argv) {
  Flags flags;
  CLI::App app{
      "Train a GPT-2 model with Tessera: in this process, on a local cluster of worker "
      "processes it starts (--workers N), or on a running cluster (--address), with data "
      "parallelism or ZeRO-1/2/3 (--zero-stage) on CPU workers.\n"
      "Output: one line per step, then 'summary: ...'. Settings such as "
      "TESSERA_CPU_THREADS can also come from the environment (below)."};
  app.footer("Settings (environment variables):\n" + tessera::Settings::Describe());
  app.option_defaults()->always_capture_default();
  CLI::Option* preset =
      app.add_option("--preset", flags.preset, "Model preset: tiny, small, gpt2-124m")
          ->check(CLI::IsMember({"tiny", "small", "gpt2-124m"}));
  AddModelFlags(app, flags);
  examples::AddThreadsFlag(app, flags.common);
  AddDataFlags(app, flags);
  examples::AddLogEveryFlag(app, flags.common);
  examples::AddPlanFlags(app, flags.common);
  examples::AddDeviceFlags(app, flags.common);
  examples::AddPipelineFlags(app, flags.common);
  examples::AddCheckpointFlags(app, flags.common);
  examples::AddClusterFlags(app, flags.common);
  examples::AddRecoveryFlags(app, flags.common);
  AddLlmcFlags(app, flags);
  examples::AddTraceFlags(app, flags.common);
  examples::AddPlacementFlag(app, flags.common);
  if (std::optional<int> exit = examples::ParseFlags(app, argc, argv, kProgram, flags.common)) {
    return *exit;
  }
  flags.preset_given = preset->count() > 0;
  if (Status status = Train(flags); !status.ok()) {
    std::fprintf(stderr, "%s: error: %s\n", kProgram, status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::RunMain(kProgram, [&] { return Main(argc, argv); });
}
