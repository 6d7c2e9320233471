// The CPU-side half of the GPU backend, which runs everywhere: the bf16 layouts GPT-2's layers
// save on a GPU, shape inference with activation_dtype, GPU plans (every GPT-2 task on the GPU,
// the offloaded optimizer on the host), and the errors a process without a GPU gives when asked
// to run one.
#include <gmock/gmock.h>

#include <set>
#include <string>

#include "core/collective_task.h"
#include "gpt2_test_util.h"
#include "model/gpt2.h"
#include "model/unet3d.h"
#include "ops/cpu/cpu_kernels.h"
#include "ops/flat_layout.h"
#include "ops/layer_program.h"
#include "ops/standard_ops.h"
#include "planner/step_graph.h"
#include "test_util.h"
#include "training/trainer.h"
#include "worker/gpu.h"
#include "worker/in_process_executor.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

TEST(GpuLayoutTest, Bf16SavedLayoutsAlignEverySlotAndWidenFp32Slots) {
  const FlatLayout f32 = TransformerBlockSavedLayout(2, 37, 64, 4);
  const FlatLayout bf16 = TransformerBlockSavedLayoutBf16(2, 37, 64, 4);
  for (const FlatSlot& slot : bf16.slots()) {
    if (slot.name.starts_with("pad.")) continue;  // padding fills up to the next slot's alignment
    EXPECT_EQ(slot.offset % kGpuSlotAlignment, 0) << slot.name;
    const int64_t f32_numel = f32.slot(slot.name).shape.numel();
    const bool fp32_slot =
        slot.name.ends_with("_mean") || slot.name.ends_with("_rstd") || slot.name == "lse";
    EXPECT_EQ(slot.shape.numel(), fp32_slot ? 2 * f32_numel : f32_numel) << slot.name;
  }
  const FlatLayout head = TiedLmHeadSavedLayoutBf16(2, 37, 64, 50257);
  EXPECT_EQ(head.slot("dlogits").shape, (Shape{74, 50304}));
  EXPECT_EQ(head.slot("losses").shape.numel(), 2 * 74);
  EXPECT_EQ(TiedLmHeadPaddedVocab(50257), 50304);
  EXPECT_EQ(TiedLmHeadPaddedVocab(256), 256);
}

TEST(GpuLayoutTest, Bf16ActivationsFlowThroughShapeInference) {
  const OpRegistry& registry = CpuRegistry();
  Attrs attrs{{"channels", int64_t{64}}, {"heads", int64_t{4}}};
  attrs.Set(kActivationDTypeAttr, std::string("bf16"));
  const TensorMeta x{Shape{2, 16, 64}, DType::kBF16};
  const TensorMeta params{Shape{TransformerBlockParamLayout(64).numel()}, DType::kF32};
  ASSERT_OK_AND_ASSIGN(auto metas,
                       registry.InferShapes("transformer_block_forward", {x, params}, attrs));
  EXPECT_EQ(metas[0], x);
  EXPECT_EQ(metas[1].dtype, DType::kBF16);
  EXPECT_EQ(metas[1].numel(), TransformerBlockSavedLayoutBf16(2, 16, 64, 4).numel());
  // f32 activations into a bf16 layer are refused, naming the input.
  const TensorMeta x32{Shape{2, 16, 64}, DType::kF32};
  auto refused = registry.InferShapes("transformer_block_forward", {x32, params}, attrs);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("input 'x'"));
  EXPECT_THAT(refused.status().message(), HasSubstr("bf16"));
  attrs.Set(kActivationDTypeAttr, std::string("f8"));
  auto unknown = registry.InferShapes("transformer_block_forward", {x, params}, attrs);
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(unknown.status().message(), HasSubstr("use f32 or bf16"));
}

Gpt2Config GpuConfig() {
  Gpt2Config config{2, 64, 4, 256, 32};
  config.activations = DType::kBF16;
  return config;
}

TEST(GpuPlanTest, EveryGpt2TaskRunsOnTheGpuAndOffloadMovesTheOptimizerToTheHost) {
  TrainingPlan plan;
  plan.batch = 2;
  plan.seq_len = 32;
  plan.device = Device::Cuda(0);
  ASSERT_OK_AND_ASSIGN(StepGraph step,
                       PlanTrainingStep(*BuildGpt2(GpuConfig()), plan, CpuRegistry()));
  for (const TaskSpec& task : step.graph.tasks()) {
    EXPECT_EQ(task.device_kind, DeviceKind::kCuda) << task.name;
  }
  plan.parallel.offload = OffloadMode::kOptimizer;
  ASSERT_OK_AND_ASSIGN(StepGraph offloaded,
                       PlanTrainingStep(*BuildGpt2(GpuConfig()), plan, CpuRegistry()));
  int host_updates = 0, copies = 0;
  for (const TaskSpec& task : offloaded.graph.tasks()) {
    if (task.op == "adamw") {
      EXPECT_EQ(task.device_kind, DeviceKind::kCpu) << task.name;
      ++host_updates;
    }
    if (task.op == "copy") ++copies;
    if (task.op.starts_with("gpt2_")) {
      EXPECT_EQ(task.device_kind, DeviceKind::kCuda) << task.name;
    }
  }
  EXPECT_EQ(host_updates, 4);  // embedding, 2 blocks, head
  EXPECT_GE(copies, 2 * 4);    // each group's gradient down and parameters up
}

// What a GPU worker needs to prepare its part of any GPT-2 plan: a kCuda kernel for every task
// placed on the GPU (the collectives' stage device buffers through the host), a CPU kernel for
// every host task. Registration needs no device, so this runs wherever the build has CUDA.
TEST(GpuPlanTest, EveryTaskOfEveryGpuPlanHasAKernelForItsDevice) {
  ASSERT_OK_AND_ASSIGN(OpRegistry registry, MakeCpuOpRegistry());
  const Status gpu = AddGpuKernels(registry);
  if (!gpu.ok()) GTEST_SKIP() << "no CUDA backend in this build: " << gpu.ToString();
  struct Case {
    std::string name;
    int data_parallel = 1, zero_stage = 0, stages = 1;
    OffloadMode offload = OffloadMode::kNone;
  };
  const std::vector<Case> cases = {
      {"one GPU"},
      {"data parallel", 2},
      {"ZeRO-1", 2, 1},
      {"ZeRO-2", 2, 2},
      {"ZeRO-3", 2, 3},
      {"ZeRO-2 offloaded", 2, 2, 1, OffloadMode::kOptimizer},
      {"two pipeline stages", 1, 0, 2},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TrainingPlan plan;
    plan.batch = 4;
    plan.seq_len = 32;
    plan.device = Device::Cuda(0);
    plan.parallel.data_parallel = c.data_parallel;
    plan.parallel.zero_stage = c.zero_stage;
    plan.parallel.pipeline_stages = c.stages;
    plan.parallel.micro_batches = c.stages;  // micro-batches for the pipeline
    plan.parallel.offload = c.offload;
    for (int w = 0; w < c.data_parallel * c.stages; ++w) {
      plan.parallel.workers.push_back(WorkerId(10 + w));
    }
    ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(*BuildGpt2(GpuConfig()), plan, registry));
    int collectives = 0;
    for (const TaskSpec& task : step.graph.tasks()) {
      EXPECT_TRUE(registry.FindKernel(task.op, task.device_kind).ok())
          << task.name << " (" << task.op << ") on " << DeviceKindName(task.device_kind);
      collectives += IsCollectiveOp(task.op);
    }
    if (c.data_parallel > 1 || c.stages > 1) {
      EXPECT_GT(collectives, 0);
    }
  }
}

// Every task of `config`'s U-Net on a GPU (alone and under ZeRO-2) and every op its layer
// programs run, forward and backward, has a CUDA kernel.
void ExpectEveryUNetOpHasAGpuKernel(const OpRegistry& registry, const UNet3dConfig& config) {
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(config, registry));
  for (int ranks : {1, 2}) {
    SCOPED_TRACE(ranks);
    TrainingPlan plan;
    plan.batch = 4;
    plan.device = Device::Cuda(0);
    plan.parallel.data_parallel = ranks;
    plan.parallel.zero_stage = ranks > 1 ? 2 : 0;
    for (int w = 0; w < ranks; ++w) plan.parallel.workers.push_back(WorkerId(10 + w));
    ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, registry));
    for (const TaskSpec& task : step.graph.tasks()) {
      EXPECT_TRUE(registry.FindKernel(task.op, task.device_kind).ok())
          << task.name << " (" << task.op << ") on " << DeviceKindName(task.device_kind);
    }
  }
  std::set<std::string> layer_ops;
  for (const LayerSpec& layer : model.layers) {
    ASSERT_OK_AND_ASSIGN(const std::string text, layer.attrs.GetString(kProgramAttr));
    ASSERT_OK_AND_ASSIGN(LayerProgram program, LayerProgram::Decode(text));
    for (const ProgramOp& op : program.ops) {
      layer_ops.insert(op.op);
      ASSERT_OK_AND_ASSIGN(const OpDef* def, registry.Find(op.op));
      if (!def->gradient.has_value()) continue;
      for (const std::string& backward :
           {def->gradient->op, def->gradient->input_op, def->gradient->weight_op}) {
        if (!backward.empty()) layer_ops.insert(backward);
      }
    }
  }
  EXPECT_GE(layer_ops.size(), 10u);
  for (const std::string& op : layer_ops) {
    EXPECT_TRUE(registry.Supports(op, DeviceKind::kCuda)) << op << " has no CUDA kernel";
  }
}

// The 3D U-Net (the model API: layer programs of volume ops) on a GPU, alone and under ZeRO-2,
// in f32 and in bf16 activations (what --device cuda trains in: the volume cast, gradients of
// bf16 activations summed in bf16): every task has a kernel for its device, and so does every op
// its layer programs run, forward and backward (the volume ops' CUDA kernels,
// ops/cuda/volume_kernels.h).
TEST(GpuPlanTest, EveryUNetTaskAndEveryOpItsLayersRunHaveAGpuKernel) {
  ASSERT_OK_AND_ASSIGN(OpRegistry registry, MakeCpuOpRegistry());
  const Status gpu = AddGpuKernels(registry);
  if (!gpu.ok()) GTEST_SKIP() << "no CUDA backend in this build: " << gpu.ToString();
  ASSERT_OK_AND_ASSIGN(UNet3dConfig small, UNet3dConfig::Preset("small"));
  // Deep supervision's loss adds the levels' terms (add_forward) and samples labels down.
  const UNet3dConfig deep{.base_channels = 4, .depth = 3, .volume = 16, .deep_supervision = true};
  for (UNet3dConfig config : {small, deep}) {
    for (const DType activations : {DType::kF32, DType::kBF16}) {
      config.activations = activations;
      SCOPED_TRACE(config.ToString() + " " + std::string(DTypeName(activations)));
      ExpectEveryUNetOpHasAGpuKernel(registry, config);
    }
  }
}

TEST(GpuPlanTest, EvaluationAndSamplingRunOnTheTrainingDevice) {
  ASSERT_OK_AND_ASSIGN(ForwardGraph eval, PlanEvalLoss(*BuildGpt2(GpuConfig()), 2, 32,
                                                       CpuRegistry(), 1, Device::Cuda(0)));
  ASSERT_OK_AND_ASSIGN(ForwardGraph logits, PlanLogits(*BuildGpt2(GpuConfig()), 2, 32,
                                                       CpuRegistry(), 1, Device::Cuda(0)));
  for (const Graph* graph : {&eval.graph, &logits.graph}) {
    for (const TaskSpec& task : graph->tasks()) {
      EXPECT_EQ(task.device_kind, DeviceKind::kCuda) << task.name;
    }
    for (const ObjectSpec& object : graph->objects()) {
      EXPECT_FALSE(object.meta.device.is_cpu()) << object.name;
    }
  }
  EXPECT_EQ(logits.graph.object(logits.result).meta.dtype, DType::kF32);
}

TEST(GpuPlanTest, AProcessWithoutAGpuRefusesAGpuGraphNamingWhy) {
  TrainingPlan plan;
  plan.batch = 2;
  plan.seq_len = 32;
  plan.device = Device::Cuda(0);
  auto trainer = Trainer::Create(*BuildGpt2(GpuConfig()), plan, ExecutorOptions{.threads = 1});
  // Without the CUDA kernels the registry has no kCuda kernel to prepare with; with them but
  // no device, the first step cannot put its inputs on the GPU.
  if (trainer.ok()) {
    ASSERT_OK((*trainer)->InitializeParameters(1));
    std::vector<int32_t> tokens(64, 1);
    auto step = Gpt2Step(**trainer, tokens, tokens, 1e-3f);
    ASSERT_FALSE(step.ok());
    EXPECT_THAT(step.status().message(), HasSubstr("no GPU"));
  } else {
    EXPECT_THAT(trainer.status().message(), HasSubstr("cuda"));
  }
}

TEST(GpuPlanTest, OpeningAMissingGpuSaysWhy) {
  auto gpu = OpenGpu(0);
  if (gpu.ok()) GTEST_SKIP() << "this machine has a GPU: " << (*gpu)->Describe();
  EXPECT_EQ(gpu.status().code(), StatusCode::kUnavailable);
  EXPECT_FALSE(gpu.status().message().empty());
  auto far = OpenGpu(64);
  EXPECT_FALSE(far.ok());
}

}  // namespace
}  // namespace tessera::testing
