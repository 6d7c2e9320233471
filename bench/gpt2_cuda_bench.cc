// bench_gpt2_cuda: GPT-2 training steps on one GPU through Tessera's runtime (the step graph on
// the in-process executor with the CUDA kernels), timed like bench/torch_gpt2_cuda.py times
// PyTorch, so scripts/gpu_check.sh can print them side by side.
//
//   bench_gpt2_cuda [--preset gpt2-124m] [--batch 16] [--seq-len 1024] [--steps 30] [--warmup 5]
//   bench_gpt2_cuda --max-batch          the largest batch (power of two) that trains a step
//   bench_gpt2_cuda --max-model --offload optimizer     the largest GPT-2-shaped model that
//                                                       trains a step (ZeRO-Offload)
//
// Prints one line per measurement:
//   tessera_step device=... params=N vocab= B= T= step_ms= tok_s= mfu= mfu_llmc= peak_gpu_gib=
//                loss= loss_timed=
// MFU by two counts of flops per token, against --peak-flops (default: H100/H200 SXM dense bf16,
// 989.4e12): mfu, 6 N + 12 L C T (attention's matmuls at full T x T, as PaLM's appendix B and
// Tessera's figures count them); mfu_llmc, 6 N + 6 L C T (llm.c's gpt2_estimate_mfu: the causal
// half). Every step trains on one batch of tokens the PyTorch script makes alike (SharedTokens),
// so loss_timed, the mean loss of the timed steps, compares the two on the same data.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench/bench_util.h"
#include "core/version.h"
#include "model/gpt2.h"
#include "training/trainer.h"
#include "worker/gpu.h"

namespace tessera::bench {
namespace {

struct Options {
  std::string preset = "gpt2-124m";
  int64_t layers = 0, channels = 0, heads = 0, vocab = 0;
  int64_t batch = 16;
  int64_t seq_len = 1024;
  int steps = 30;
  int warmup = 5;
  double peak_flops = 989.4e12;
  std::string offload = "none";
  bool max_batch = false;
  bool max_model = false;
  size_t from_shape = 0;  // --max-model: the first shape tried (smaller ones assumed to fit)
  double gpu_memory_gib = 0;
};

struct Measured {
  int64_t params = 0;
  double step_ms = 0;
  double tok_s = 0;
  double mfu = 0, mfu_llmc = 0;
  double peak_gib = 0;
  float loss = 0;
  double loss_timed = 0;  // the mean over the timed steps
};

// Token i of the batch (inputs, then targets from i = batch x T on): an LCG both benchmarks
// compute alike (bench/torch_gpt2_cuda.py's shared_tokens), so they train on the same data.
int32_t SharedToken(int64_t i, int64_t vocab) {
  return static_cast<int32_t>(((i * 1103515245 + 12345) % (int64_t{1} << 31)) % vocab);
}

Result<Measured> Measure(Gpt2Config config, const Options& o, int64_t batch, int steps,
                         int warmup) {
  config.activations = GpuActivations();  // bf16 (f32 on the simulated GPU)
  ExecutorOptions executor;
  // Four threads launch GPU tasks; an offloaded optimizer steps on the host, on every core.
  executor.threads = o.offload == "none" ? 4 : 0;
  TESSERA_ASSIGN_OR_RETURN(executor.device,
                           OpenGpu(0, static_cast<int64_t>(o.gpu_memory_gib * (1 << 30))));
  std::shared_ptr<DeviceRuntime> device = executor.device;
  TrainingPlan plan;
  plan.device = Device::Cuda(0);
  plan.batch = batch;
  plan.seq_len = o.seq_len;
  plan.optimizer.beta2 = 0.95;
  TESSERA_ASSIGN_OR_RETURN(plan.parallel.offload, ParseOffload(o.offload));
  // Progress on stderr (a model-size search under a time limit says where its time went).
  const auto began = std::chrono::steady_clock::now();
  const auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  };
  TESSERA_ASSIGN_OR_RETURN(ModelSpec model, BuildGpt2(config));
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                           Trainer::Create(std::move(model), plan, executor));
  std::fprintf(stderr,
               "bench_gpt2_cuda: %lld parameters (%lld x %lld): state allocated in %.1f s; "
               "initialising\n",
               static_cast<long long>(config.NumParameters()),
               static_cast<long long>(config.layers), static_cast<long long>(config.channels),
               seconds());
  TESSERA_RETURN_IF_ERROR(trainer->InitializeParameters(1));
  std::fprintf(stderr, "bench_gpt2_cuda: initialised in %.1f s\n", seconds());
  std::vector<int32_t> x(static_cast<size_t>(batch * o.seq_len)), y(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = SharedToken(static_cast<int64_t>(i), config.vocab);
    y[i] = SharedToken(static_cast<int64_t>(i + x.size()), config.vocab);
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<Tensor> inputs, Gpt2Batch(config, x, y, batch, o.seq_len));
  std::vector<double> times;
  Measured m;
  for (int step = 0; step < warmup + steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    // Step returns after the loss came back to the host: the step's GPU work is done.
    TESSERA_ASSIGN_OR_RETURN(StepReport report, trainer->Step(inputs, 3e-4f));
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (step >= warmup) {
      times.push_back(ms);
      m.loss_timed += report.loss / steps;
    }
    m.loss = report.loss;
    if (config.NumParameters() > (int64_t{1} << 30)) {
      std::fprintf(stderr, "bench_gpt2_cuda: step %d: %.1f s (%.1f s since the start)\n", step + 1,
                   ms / 1e3, seconds());
    }
  }
  m.params = config.NumParameters();
  m.step_ms = Median(times);
  const double tokens = static_cast<double>(batch * o.seq_len);
  m.tok_s = tokens / (m.step_ms / 1e3);
  const double attention = static_cast<double>(config.layers * config.channels * o.seq_len);
  m.mfu = m.tok_s * (6.0 * static_cast<double>(m.params) + 12.0 * attention) / o.peak_flops;
  m.mfu_llmc = m.tok_s * (6.0 * static_cast<double>(m.params) + 6.0 * attention) / o.peak_flops;
  m.peak_gib = static_cast<double>(device->memory().peak_bytes) / double(1 << 30);
  return m;
}

void Print(const Gpt2Config& config, const Options& o, int64_t batch, const Measured& m) {
  std::printf(
      "tessera_step device=cuda params=%lld layers=%lld channels=%lld vocab=%lld B=%lld T=%lld "
      "offload=%s step_ms=%.2f tok_s=%.0f mfu=%.4f mfu_llmc=%.4f peak_gpu_gib=%.2f loss=%.4f "
      "loss_timed=%.4f\n",
      static_cast<long long>(m.params), static_cast<long long>(config.layers),
      static_cast<long long>(config.channels), static_cast<long long>(config.vocab),
      static_cast<long long>(batch), static_cast<long long>(o.seq_len), o.offload.c_str(),
      m.step_ms, m.tok_s, m.mfu, m.mfu_llmc, m.peak_gib, m.loss, m.loss_timed);
  std::fflush(stdout);
}

// GPT-2-shaped models of growing size (the PyTorch script tries the same list); head sizes 64
// or 128, which the attention kernels take.
const std::vector<Gpt2Config>& Shapes() {
  static const std::vector<Gpt2Config> shapes = {
      {12, 768, 12, 50257, 1024},  {24, 1024, 16, 50257, 1024}, {36, 1280, 20, 50257, 1024},
      {48, 1600, 25, 50257, 1024}, {32, 2560, 20, 50257, 1024}, {40, 3072, 24, 50257, 1024},
      {32, 4096, 32, 50257, 1024}, {40, 4096, 32, 50257, 1024}, {44, 4096, 32, 50257, 1024},
      {48, 4096, 32, 50257, 1024}, {40, 5120, 40, 50257, 1024}, {48, 5120, 40, 50257, 1024},
      {60, 5120, 40, 50257, 1024}, {48, 6144, 48, 50257, 1024}, {64, 6144, 48, 50257, 1024}};
  return shapes;
}

int Main(int argc, char** argv) {
  Options o;
  CLI::App app{"GPT-2 training steps on one GPU (Tessera's runtime and CUDA kernels)"};
  app.set_version_flag("--version", tessera::VersionLine("bench_gpt2_cuda"));
  app.add_option("--preset", o.preset, "tiny, small or gpt2-124m");
  app.add_option("--layers", o.layers, "Override the preset's layers");
  app.add_option("--channels", o.channels, "Override the preset's channels");
  app.add_option("--heads", o.heads, "Override the preset's heads");
  app.add_option("--vocab", o.vocab,
                 "Override the preset's vocabulary (50304: GPT-2's padded to a multiple of 128)");
  app.add_option("--batch", o.batch, "Sequences per step")->check(CLI::PositiveNumber);
  app.add_option("--seq-len", o.seq_len, "Tokens per sequence")->check(CLI::PositiveNumber);
  app.add_option("--steps", o.steps, "Timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "Untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--peak-flops", o.peak_flops, "The GPU's dense bf16 peak, for MFU");
  app.add_option("--offload", o.offload,
                 "none, optimizer (ZeRO-Offload) or parameters (the parameters too, copied up "
                 "for each use)");
  app.add_option("--gpu-memory-gib", o.gpu_memory_gib, "Cap on the GPU allocator (0: all)");
  app.add_flag("--max-batch", o.max_batch, "Find the largest power-of-two batch that trains");
  app.add_flag("--max-model", o.max_model, "Find the largest GPT-2-shaped model that trains");
  app.add_option("--from-shape", o.from_shape,
                 "--max-model: start at this index of the shape list (as the PyTorch script)")
      ->check(CLI::Range(size_t{0}, Shapes().size() - 1));
  CLI11_PARSE(app, argc, argv);

  Result<Gpt2Config> preset = Gpt2Config::Preset(o.preset);
  if (!preset.ok()) Die("bench_gpt2_cuda", preset.status(), "--preset");
  Gpt2Config config = *preset;
  if (o.layers) config.layers = o.layers;
  if (o.channels) config.channels = o.channels;
  if (o.heads) config.heads = o.heads;
  if (o.vocab) config.vocab = o.vocab;
  if (o.max_model) {
    for (size_t i = o.from_shape; i < Shapes().size(); ++i) {
      const Gpt2Config& shape = Shapes()[i];
      Result<Measured> m = Measure(shape, o, o.batch, 1, 1);
      if (!m.ok()) {
        std::printf("try layers=%lld channels=%lld: failed: %s\n",
                    static_cast<long long>(shape.layers), static_cast<long long>(shape.channels),
                    m.status().ToString().c_str());
        break;
      }
      std::printf("try layers=%lld channels=%lld: ok\n", static_cast<long long>(shape.layers),
                  static_cast<long long>(shape.channels));
      Print(shape, o, o.batch, *m);
    }
    return 0;
  }
  if (o.max_batch) {
    for (int64_t batch = o.batch;; batch *= 2) {
      Result<Measured> m = Measure(config, o, batch, 2, 1);
      if (!m.ok()) {
        std::printf("try B=%lld: failed: %s\n", static_cast<long long>(batch),
                    m.status().ToString().c_str());
        break;
      }
      Print(config, o, batch, *m);
    }
    return 0;
  }
  Result<Measured> m = Measure(config, o, o.batch, o.steps, o.warmup);
  if (!m.ok()) Die("bench_gpt2_cuda", m.status(), "the step");
  Print(config, o, o.batch, *m);
  return 0;
}

}  // namespace
}  // namespace tessera::bench

int main(int argc, char** argv) {
  return tessera::bench::RunMain("bench_gpt2_cuda",
                                 [&] { return tessera::bench::Main(argc, argv); });
}
