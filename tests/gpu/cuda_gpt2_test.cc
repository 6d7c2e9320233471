// GPT-2 on a GPU against the CPU: each layer's forward and backward (ops/cuda/transformer_layers.h
// vs ops/cpu/transformer_layers.h) on the same bf16-representable inputs, then whole training runs
// in process (Trainer with --device cuda's executor) against the CPU's losses, plain and with the
// optimizer offloaded to the host (ZeRO-Offload on one GPU). Skips without a device.
//
// Tolerances: the GPU keeps activations in bf16 (8-bit mantissa, relative rounding 2^-9 ~ 2e-3
// per value) and rounds after every layer, so a block's outputs differ from the fp32 CPU by a few
// roundings: 2e-2 relative (||gpu - cpu|| / ||cpu||) for activations and gradients. Losses of a
// short training run move together to well under 1% (the loss is a mean over many tokens, which
// averages the rounding): 1e-2 relative per step.
#include <cmath>
#include <memory>
#include <vector>

#include <gmock/gmock.h>

#include "gpt2_test_util.h"
#include "gpu_test_util.h"
#include "ops/cpu/transformer_layers.h"
#include "ops/cuda/cuda_context.h"
#include "ops/cuda/transformer_layers.h"
#include "ops/flat_layout.h"
#include "test_util.h"
#include "training/trainer.h"
#include "worker/gpu.h"

namespace tessera::testing {
namespace {

// CPU and GPU layers take the same dimensions (ops/flat_layout.h).
using Dims = TransformerDims;

// Parameters as a trained layer has them: matrices ~N(0, 0.02)-sized, layernorm gains near 1.
std::vector<float> BlockParams(const FlatLayout& layout, uint64_t seed) {
  std::vector<float> params(static_cast<size_t>(layout.numel()));
  for (const FlatSlot& slot : layout.slots()) {
    const bool gain = slot.name == "ln1_w" || slot.name == "ln2_w" || slot.name == "lnf_w";
    std::vector<float> values =
        RandomFloats(slot.shape.numel(), seed++, gain ? 0.8f : -0.05f, gain ? 1.2f : 0.05f);
    std::copy(values.begin(), values.end(), params.begin() + slot.offset);
  }
  return params;
}

// The elements of slot `name` of a bf16 saved buffer, as floats.
std::vector<float> Bf16Slot(const std::vector<__nv_bfloat16>& saved, const FlatLayout& layout,
                            const char* name) {
  const FlatSlot& slot = layout.slot(name);
  std::vector<__nv_bfloat16> part(saved.begin() + slot.offset,
                                  saved.begin() + slot.offset + slot.shape.numel());
  return ToF32(part);
}
std::vector<float> F32Slot(const std::vector<float>& values, const FlatLayout& layout,
                           const char* name) {
  const FlatSlot& slot = layout.slot(name);
  return {values.begin() + slot.offset, values.begin() + slot.offset + slot.shape.numel()};
}

class CudaGpt2Test : public ::testing::TestWithParam<Dims> {
 protected:
  void SetUp() override {
    const CudaDevices probe = ProbeCudaDevices();
    if (probe.devices.empty()) GTEST_SKIP() << "no CUDA device: " << probe.reason;
    auto context = cuda::CudaContext::Create({});
    ASSERT_TRUE(context.ok()) << context.status().ToString();
    context_ = *context;
  }
  std::shared_ptr<cuda::CudaContext> context_;
};

TEST_P(CudaGpt2Test, BlockForwardAndBackwardMatchTheCpu) {
  const Dims d = GetParam();
  const int64_t n = d.rows(), c = d.channels;
  const FlatLayout params_layout = TransformerBlockParamLayout(c);
  const FlatLayout cpu_saved_layout = TransformerBlockSavedLayout(d.batch, d.seq_len, c, d.heads);
  const FlatLayout gpu_saved_layout =
      TransformerBlockSavedLayoutBf16(d.batch, d.seq_len, c, d.heads);
  const std::vector<float> params = BlockParams(params_layout, 11);
  const std::vector<float> x = RoundToBf16(RandomFloats(n * c, 12));
  const std::vector<float> dy = RoundToBf16(RandomFloats(n * c, 13, -0.1f, 0.1f));

  // CPU, fp32.
  std::vector<float> y_cpu(static_cast<size_t>(n * c));
  std::vector<float> saved_cpu(static_cast<size_t>(cpu_saved_layout.numel()));
  cpu::TransformerBlockForward(y_cpu.data(), saved_cpu.data(), nullptr, x.data(), params.data(), d,
                               1 << 30);
  std::vector<float> dx_cpu = dy;
  std::vector<float> dparams_cpu(params.size());
  std::vector<float> workspace(static_cast<size_t>(TransformerBlockBackwardWorkspace(d)));
  cpu::TransformerBlockBackward(dx_cpu.data(), dparams_cpu.data(), workspace.data(), x.data(),
                                saved_cpu.data(), params.data(), d, 1 << 30);

  // GPU, bf16 activations.
  DeviceBuffer<float> params_gpu(params);
  DeviceBuffer<__nv_bfloat16> x_gpu(ToBf16(x));
  DeviceBuffer<__nv_bfloat16> y_gpu(n * c);
  DeviceBuffer<__nv_bfloat16> saved_gpu(gpu_saved_layout.numel());
  y_gpu.Poison();
  saved_gpu.Poison();
  ASSERT_OK(cuda::TransformerBlockForward(*context_, y_gpu.get(), saved_gpu.get(), x_gpu.get(),
                                          params_gpu.get(), d));
  DeviceBuffer<__nv_bfloat16> d_gpu(ToBf16(dy));
  DeviceBuffer<float> dparams_gpu(static_cast<int64_t>(params.size()));
  dparams_gpu.Poison();
  ASSERT_OK(cuda::TransformerBlockBackward(*context_, d_gpu.get(), dparams_gpu.get(), x_gpu.get(),
                                           saved_gpu.get(), params_gpu.get(), d));
  ASSERT_OK(context_->Synchronize());

  const std::vector<__nv_bfloat16> saved = saved_gpu.Download();
  EXPECT_LT(RelativeError(ToF32(y_gpu.Download()), y_cpu), 2e-2) << "y";
  for (const char* name : {"ln1", "qkv", "atty", "x_mid", "ln2", "fch", "fch_gelu"}) {
    EXPECT_LT(RelativeError(Bf16Slot(saved, gpu_saved_layout, name),
                            F32Slot(saved_cpu, cpu_saved_layout, name)),
              2e-2)
        << "saved " << name;
  }
  EXPECT_LT(RelativeError(ToF32(d_gpu.Download()), dx_cpu), 2e-2) << "dx";
  const std::vector<float> dparams = dparams_gpu.Download();
  for (const FlatSlot& slot : params_layout.slots()) {
    EXPECT_LT(RelativeError(F32Slot(dparams, params_layout, slot.name.c_str()),
                            F32Slot(dparams_cpu, params_layout, slot.name.c_str())),
              3e-2)
        << "d" << slot.name;
  }
}

TEST_P(CudaGpt2Test, EmbeddingAndHeadMatchTheCpu) {
  const Dims d = GetParam();
  const int64_t n = d.rows(), c = d.channels, v = d.vocab;
  const FlatLayout emb_layout = TokenPositionEmbeddingParamLayout(v, d.max_seq_len, c);
  const FlatLayout head_layout = TiedLmHeadParamLayout(c);
  const FlatLayout cpu_saved_layout = TiedLmHeadSavedLayout(d.batch, d.seq_len, c, v);
  const FlatLayout gpu_saved_layout = TiedLmHeadSavedLayoutBf16(d.batch, d.seq_len, c, v);
  const std::vector<float> emb = RandomFloats(emb_layout.numel(), 21, -0.1f, 0.1f);
  const std::vector<float> head = BlockParams(head_layout, 22);
  const std::vector<int32_t> tokens = RandomInts(n, 23, 0, static_cast<int32_t>(v));
  const std::vector<int32_t> targets = RandomInts(n, 24, 0, static_cast<int32_t>(v));
  const float* wte_cpu = emb.data() + emb_layout.offset("wte");

  // CPU: embedding, then the head on the (bf16-rounded) embedding output.
  std::vector<float> x_cpu(static_cast<size_t>(n * c));
  ASSERT_OK(cpu::TokenPositionEmbeddingForward(x_cpu.data(), tokens.data(), emb.data(), d));
  const std::vector<float> x = RoundToBf16(x_cpu);
  std::vector<float> saved_cpu(static_cast<size_t>(cpu_saved_layout.numel()));
  ASSERT_OK_AND_ASSIGN(float loss_cpu,
                       cpu::TiedLmHeadForward(saved_cpu.data(), x.data(), head.data(), wte_cpu,
                                              targets.data(), d, 1.0f, 1 << 30));
  std::vector<float> dx_cpu(x.size()), dhead_cpu(head.size()), demb_cpu(emb.size());
  std::vector<float> workspace(static_cast<size_t>(TiedLmHeadWorkspace(d)));
  cpu::TiedLmHeadBackward(dx_cpu.data(), dhead_cpu.data(), demb_cpu.data(), workspace.data(),
                          x.data(), saved_cpu.data(), head.data(), wte_cpu, d, 1 << 30);
  cpu::TokenPositionEmbeddingBackward(demb_cpu.data(), RoundToBf16(dx_cpu).data(), tokens.data(),
                                      d);

  // GPU.
  DeviceBuffer<float> emb_gpu(emb), head_gpu(head);
  DeviceBuffer<int32_t> tokens_gpu(tokens), targets_gpu(targets);
  DeviceBuffer<__nv_bfloat16> x_gpu(n * c), saved_gpu(gpu_saved_layout.numel()), dx_gpu(n * c);
  DeviceBuffer<float> loss_gpu(1), dhead_gpu(static_cast<int64_t>(head.size())),
      demb_gpu(static_cast<int64_t>(emb.size()));
  for (auto* poisoned : {&x_gpu, &saved_gpu, &dx_gpu}) poisoned->Poison();
  for (auto* poisoned : {&loss_gpu, &dhead_gpu, &demb_gpu}) poisoned->Poison();
  const float* wte_gpu = emb_gpu.get() + emb_layout.offset("wte");
  ASSERT_OK(cuda::TokenPositionEmbeddingForward(*context_, x_gpu.get(), tokens_gpu.get(),
                                                emb_gpu.get(), d));
  EXPECT_LT(RelativeError(ToF32(x_gpu.Download()), x), 1e-6) << "embedding output";
  ASSERT_OK(cuda::TiedLmHeadForward(*context_, loss_gpu.get(), saved_gpu.get(), x_gpu.get(),
                                    head_gpu.get(), wte_gpu, targets_gpu.get(), d, 1.0f));
  ASSERT_OK(cuda::TiedLmHeadBackward(*context_, dx_gpu.get(), dhead_gpu.get(), demb_gpu.get(),
                                     x_gpu.get(), saved_gpu.get(), head_gpu.get(), wte_gpu, d));
  ASSERT_OK(cuda::TokenPositionEmbeddingBackward(*context_, demb_gpu.get(), dx_gpu.get(),
                                                 tokens_gpu.get(), d));
  ASSERT_OK(context_->Synchronize());

  EXPECT_NEAR(loss_gpu.Download()[0], loss_cpu, 1e-2 * loss_cpu) << "loss";
  EXPECT_LT(RelativeError(ToF32(dx_gpu.Download()), dx_cpu), 2e-2) << "dx";
  EXPECT_LT(RelativeError(dhead_gpu.Download(), dhead_cpu), 2e-2) << "dhead";
  const std::vector<float> demb = demb_gpu.Download();
  for (const char* name : {"wte", "wpe"}) {
    EXPECT_LT(RelativeError(F32Slot(demb, emb_layout, name), F32Slot(demb_cpu, emb_layout, name)),
              2e-2)
        << "d" << name;
  }
}

TEST_P(CudaGpt2Test, HeadLogitsMatchTheCpu) {
  const Dims d = GetParam();
  const int64_t n = d.rows(), c = d.channels, v = d.vocab;
  const std::vector<float> head = BlockParams(TiedLmHeadParamLayout(c), 41);
  const std::vector<float> wte = RandomFloats(v * c, 42, -0.1f, 0.1f);
  const std::vector<float> x = RoundToBf16(RandomFloats(n * c, 43));
  std::vector<float> logits_cpu(static_cast<size_t>(n * v));
  std::vector<float> workspace(static_cast<size_t>(TiedLmHeadWorkspace(d)));
  cpu::TiedLmHeadLogits(logits_cpu.data(), workspace.data(), x.data(), head.data(), wte.data(), d,
                        1 << 30);
  DeviceBuffer<float> head_gpu(head), wte_gpu(wte), logits_gpu(n * v);
  DeviceBuffer<__nv_bfloat16> x_gpu(ToBf16(x));
  logits_gpu.Poison();
  ASSERT_OK(cuda::TiedLmHeadLogits(*context_, logits_gpu.get(), x_gpu.get(), head_gpu.get(),
                                   wte_gpu.get(), d));
  EXPECT_LT(RelativeError(logits_gpu.Download(), logits_cpu), 2e-2);
}

TEST_P(CudaGpt2Test, ATokenOutsideTheVocabularyIsNamed) {
  const Dims d = GetParam();
  const FlatLayout emb_layout =
      TokenPositionEmbeddingParamLayout(d.vocab, d.max_seq_len, d.channels);
  std::vector<int32_t> tokens = RandomInts(d.rows(), 31, 0, static_cast<int32_t>(d.vocab));
  tokens[static_cast<size_t>(d.rows() - 1)] = static_cast<int32_t>(d.vocab);  // the last one
  DeviceBuffer<float> emb_gpu(RandomFloats(emb_layout.numel(), 32));
  DeviceBuffer<int32_t> tokens_gpu(tokens);
  DeviceBuffer<__nv_bfloat16> x_gpu(d.rows() * d.channels);
  const Status status = cuda::TokenPositionEmbeddingForward(*context_, x_gpu.get(),
                                                            tokens_gpu.get(), emb_gpu.get(), d);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  EXPECT_THAT(status.message(), ::testing::HasSubstr("outside the vocabulary"));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaGpt2Test,
                         ::testing::Values(Dims{2, 64, 64, 4, 256, 64},      // tiny: hs 16
                                           Dims{2, 128, 256, 4, 1000, 128},  // hs 64
                                           Dims{1, 100, 128, 2, 50257, 128}  // GPT-2's vocab
                                           ));

// Losses of a short in-process training run on the GPU against the same run on the CPU.
struct RunResult {
  std::vector<float> losses;
  float eval_loss = 0;        // of the first batch, after training
  std::vector<float> logits;  // of the first batch, after training
};

Result<RunResult> Train(Gpt2Config config, TrainingPlan plan, bool gpu, int steps) {
  ExecutorOptions options;
  options.threads = 2;
  if (gpu) {
    TESSERA_ASSIGN_OR_RETURN(options.device, OpenGpu(0));
    config.activations = DType::kBF16;
    plan.device = Device::Cuda(0);
  }
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                           Trainer::Create(*BuildGpt2(config), plan, options));
  TESSERA_RETURN_IF_ERROR(trainer->InitializeParameters(7));
  RunResult result;
  const int64_t tokens = plan.batch * plan.seq_len;
  for (int step = 0; step < steps; ++step) {
    // Learnable data: each target is the next token of a fixed pattern, so the loss falls.
    std::vector<int32_t> x(static_cast<size_t>(tokens)), y(static_cast<size_t>(tokens));
    for (int64_t i = 0; i < tokens; ++i) {
      x[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7 + step) % config.vocab);
      y[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7 + step + 7) % config.vocab);
    }
    TESSERA_ASSIGN_OR_RETURN(StepReport report, Gpt2Step(*trainer, x, y, 1e-3f));
    result.losses.push_back(report.loss);
  }
  // Evaluation and sampling run where training did (on the GPU: the eval and logits graphs).
  std::vector<int32_t> x(static_cast<size_t>(tokens)), y(static_cast<size_t>(tokens));
  for (int64_t i = 0; i < tokens; ++i) {
    x[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7) % config.vocab);
    y[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7 + 7) % config.vocab);
  }
  TESSERA_ASSIGN_OR_RETURN(result.eval_loss, Gpt2EvalLoss(*trainer, x, y));
  TESSERA_ASSIGN_OR_RETURN(result.logits, Gpt2Logits(*trainer, x, plan.batch, plan.seq_len));
  return result;
}

class CudaTrainingTest : public ::testing::TestWithParam<OffloadMode> {};

TEST_P(CudaTrainingTest, TenStepsOfGpt2FollowTheCpuLosses) {
  TESSERA_REQUIRE_GPU();
  const Gpt2Config config{2, 128, 2, 512, 64};
  TrainingPlan plan;
  plan.batch = 4;
  plan.seq_len = 64;
  plan.parallel.offload = GetParam();
  ASSERT_OK_AND_ASSIGN(RunResult cpu, Train(config, TrainingPlan{plan.batch, plan.seq_len, {}},
                                            /*gpu=*/false, 10));
  ASSERT_OK_AND_ASSIGN(RunResult gpu, Train(config, plan, /*gpu=*/true, 10));
  double worst = 0;
  for (size_t i = 0; i < cpu.losses.size(); ++i) {
    const double relative = std::abs(gpu.losses[i] - cpu.losses[i]) / cpu.losses[i];
    worst = std::max(worst, relative);
    EXPECT_LT(relative, 1e-2) << "step " << i + 1 << ": gpu " << gpu.losses[i] << " cpu "
                              << cpu.losses[i];
  }
  EXPECT_LT(cpu.losses.back(), cpu.losses.front());  // it learns
  EXPECT_NEAR(gpu.eval_loss, cpu.eval_loss, 1e-2 * cpu.eval_loss);
  EXPECT_LT(RelativeError(gpu.logits, cpu.logits), 3e-2);
  std::printf(
      "worst relative loss difference over %zu steps: %.2e (first %.4f, last gpu %.4f "
      "cpu %.4f)\n",
      cpu.losses.size(), worst, cpu.losses.front(), gpu.losses.back(), cpu.losses.back());
}

INSTANTIATE_TEST_SUITE_P(Plans, CudaTrainingTest,
                         ::testing::Values(OffloadMode::kNone, OffloadMode::kOptimizer));

}  // namespace
}  // namespace tessera::testing
