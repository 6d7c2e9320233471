// The simulated GPU (worker/simulated_gpu.h): scrambled device memory that only Copy reads, the
// CPU kernels as its kernels, and how TESSERA_SIMULATED_GPU=1 routes OpenGpu / ResolveGpus to it.
#include <stdlib.h>

#include <cstring>

#include "core/cuda_device.h"
#include "data/volumes.h"
#include "gpt2_test_util.h"
#include "model/unet3d.h"
#include "ops/cpu/cpu_kernels.h"
#include "test_util.h"
#include "training/trainer.h"
#include "worker/gpu.h"
#include "worker/simulated_gpu.h"
#include "worker/task_runner.h"

namespace tessera::testing {
namespace {

TEST(SimulatedGpuTest, DeviceBytesAreScrambledAndOnlyCopyReadsThem) {
  std::shared_ptr<DeviceRuntime> gpu = MakeSimulatedGpu();
  const Tensor host = RandomTensor({256}, 1);
  const KernelContext context{TestAllocator(), 0, nullptr, gpu.get()};
  ASSERT_OK_AND_ASSIGN(Tensor on_gpu,
                       MoveTo({Shape{256}, DType::kF32, Device::Cuda(0)}, host, context));
  EXPECT_EQ(on_gpu.meta().device, Device::Cuda(0));
  // Read directly, the device buffer is not the values (a host read of device memory is a bug).
  EXPECT_NE(std::memcmp(on_gpu.raw_data(), host.raw_data(), static_cast<size_t>(host.bytes())), 0);
  ASSERT_OK_AND_ASSIGN(Tensor back, HostCopyOf(on_gpu, context));
  EXPECT_EQ(ToVector(back), ToVector(host));
  EXPECT_EQ(gpu->memory().live_bytes, host.bytes());
}

TEST(SimulatedGpuTest, ItsKernelsAreTheCpuKernelsOnHostCopies) {
  ASSERT_OK_AND_ASSIGN(OpRegistry registry, MakeCpuOpRegistry());
  ASSERT_OK(AddSimulatedGpuKernels(registry));
  EXPECT_TRUE(registry.Supports("transformer_block_forward", DeviceKind::kCuda));
  std::shared_ptr<DeviceRuntime> gpu = MakeSimulatedGpu();
  const KernelContext context{TestAllocator(), 0, &registry, gpu.get()};
  const TensorMeta on_gpu{Shape{64}, DType::kF32, Device::Cuda(0)};
  const Tensor x = RandomTensor({64}, 2);
  ASSERT_OK_AND_ASSIGN(Tensor x_gpu, MoveTo(on_gpu, x, context));
  ASSERT_OK_AND_ASSIGN(Tensor y_gpu, AllocateOn(on_gpu, context));
  ASSERT_OK_AND_ASSIGN(const KernelFn* kernel,
                       registry.FindKernel("gelu_forward", DeviceKind::kCuda));
  ASSERT_OK((*kernel)(context, {x_gpu}, {y_gpu}, {}));
  ASSERT_OK_AND_ASSIGN(Tensor y, HostCopyOf(y_gpu, context));
  EXPECT_EQ(ToVector(y), ToVector((*RunKernel("gelu_forward", {x}))[0]));
}

// Its meter reports the part of each sample period in which its kernels ran: some after kernels
// ran, none over a period without one; its memory is its allocator's of its cap.
TEST(SimulatedGpuTest, ItsMeterCountsTheTimeItsKernelsRan) {
  ASSERT_OK_AND_ASSIGN(OpRegistry registry, MakeCpuOpRegistry());
  ASSERT_OK(AddSimulatedGpuKernels(registry));
  std::shared_ptr<DeviceRuntime> gpu = MakeSimulatedGpu(int64_t{1} << 30);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMeter> meter, MakeSimulatedGpuMeter(gpu));
  const KernelContext context{TestAllocator(), 0, &registry, gpu.get()};
  const TensorMeta on_gpu{Shape{1 << 16}, DType::kF32, Device::Cuda(0)};
  ASSERT_OK_AND_ASSIGN(Tensor x_gpu, MoveTo(on_gpu, RandomTensor({1 << 16}, 3), context));
  ASSERT_OK_AND_ASSIGN(Tensor y_gpu, AllocateOn(on_gpu, context));
  ASSERT_OK_AND_ASSIGN(const KernelFn* kernel,
                       registry.FindKernel("gelu_forward", DeviceKind::kCuda));
  for (int i = 0; i < 20; ++i) ASSERT_OK((*kernel)(context, {x_gpu}, {y_gpu}, {}));
  ASSERT_OK_AND_ASSIGN(GpuUse busy, meter->Sample());
  EXPECT_GT(busy.utilization, 0);
  EXPECT_LE(busy.utilization, 1);
  EXPECT_GE(busy.memory_used, 2 * x_gpu.bytes());
  EXPECT_EQ(busy.memory_total, int64_t{1} << 30);
  ASSERT_OK_AND_ASSIGN(GpuUse idle, meter->Sample());
  EXPECT_EQ(idle.utilization, 0);
  EXPECT_EQ(MakeSimulatedGpuMeter(nullptr).status().code(), StatusCode::kInvalidArgument);
}

TEST(SimulatedGpuTest, TheEnvironmentRoutesGpuRequestsToIt) {
  ::setenv("TESSERA_SIMULATED_GPU", "1", 1);
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<DeviceRuntime> gpu, OpenGpu(0));
  EXPECT_NE(gpu->Describe().find("simulated"), std::string::npos);
  EXPECT_OK(OpenGpuMeter(0, gpu).status());
  EXPECT_EQ(OpenGpu(1).status().code(), StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(std::vector<int> all, ResolveGpus("all"));
  EXPECT_EQ(all, std::vector<int>{0});
  EXPECT_EQ(ResolveGpus("0,1").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(GpuActivations(), DType::kF32);
  ::unsetenv("TESSERA_SIMULATED_GPU");
  EXPECT_EQ(GpuActivations(), DType::kBF16);
  if (ProbeCudaDevices().devices.empty()) {  // no GPU here: no meter, and the reason given
    EXPECT_EQ(OpenGpuMeter(0, gpu).status().code(), StatusCode::kUnavailable);
  }
  EXPECT_EQ(ResolveGpus("x").status().code(), StatusCode::kInvalidArgument);
}

// A step on the process's own GPU reports the GPU memory it peaked at (what train_gpt2 prints as
// gpu_peak_mb): at least the parameters, which live there; a CPU step reports none.
TEST(SimulatedGpuTest, AStepReportsItsGpuMemoryPeak) {
  ::setenv("TESSERA_SIMULATED_GPU", "1", 1);
  Gpt2Config config{2, 64, 4, 128, 32};
  config.activations = GpuActivations();
  TrainingPlan plan;
  plan.batch = 2;
  plan.seq_len = 32;
  plan.device = Device::Cuda(0);
  ExecutorOptions options;
  options.threads = 2;
  ASSERT_OK_AND_ASSIGN(options.device, OpenGpu(0));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Trainer> trainer,
                       Trainer::Create(*BuildGpt2(config), plan, options));
  ASSERT_OK(trainer->InitializeParameters(1));
  std::vector<int32_t> tokens(static_cast<size_t>(plan.batch * plan.seq_len), 3);
  ASSERT_OK_AND_ASSIGN(StepReport report, Gpt2Step(*trainer, tokens, tokens, 1e-3f));
  ::unsetenv("TESSERA_SIMULATED_GPU");
  EXPECT_GE(report.device_peak_bytes, trainer->ParameterBytes());
  EXPECT_LE(report.device_peak_bytes, options.device->memory().capacity_bytes);

  plan.device = Device::Cpu();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Trainer> on_cpu,
                       Trainer::Create(*BuildGpt2(config), plan, ExecutorOptions{}));
  ASSERT_OK(on_cpu->InitializeParameters(1));
  ASSERT_OK_AND_ASSIGN(StepReport cpu_report, Gpt2Step(*on_cpu, tokens, tokens, 1e-3f));
  EXPECT_EQ(cpu_report.device_peak_bytes, 0);
  EXPECT_GT(cpu_report.peak_bytes, 0);
}

// The model API's layers on a device: the tiny 3D U-Net's layer programs run their volume ops on
// the simulated GPU (scrambled device memory: a host read or write of a device value inside a
// program would change the numbers) and train the CPU's losses, step for step.
TEST(SimulatedGpuTest, LayerProgramsTrainOnTheDeviceAsOnTheCpu) {
  const UNet3dConfig config = *UNet3dConfig::Preset("tiny");
  const int64_t v = config.volume;
  std::vector<std::vector<Tensor>> batches;
  for (int step = 0; step < 4; ++step) {
    ASSERT_OK_AND_ASSIGN(VolumeBatch made, GenerateVolumes(2, v, config.in_channels, 30 + step));
    batches.push_back({FloatTensor(Shape{2, config.in_channels, v, v, v}, made.volumes),
                       IntTensor(Shape{2, v, v, v}, made.labels)});
  }
  const auto train = [&](bool on_gpu) -> Result<std::vector<float>> {
    TrainingPlan plan;
    plan.batch = 2;
    ExecutorOptions options;
    options.threads = 2;
    if (on_gpu) {
      plan.device = Device::Cuda(0);
      TESSERA_ASSIGN_OR_RETURN(options.device, OpenGpu(0));
    }
    TESSERA_ASSIGN_OR_RETURN(ModelSpec model, BuildUNet3d(config, CpuRegistry()));
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                             Trainer::Create(model, plan, options));
    TESSERA_RETURN_IF_ERROR(trainer->InitializeParameters(1));
    std::vector<float> losses;
    for (const std::vector<Tensor>& batch : batches) {
      TESSERA_ASSIGN_OR_RETURN(StepReport report, trainer->Step(batch, 3e-3f));
      losses.push_back(report.loss);
    }
    return losses;
  };
  ASSERT_OK_AND_ASSIGN(std::vector<float> on_cpu, train(false));
  ::setenv("TESSERA_SIMULATED_GPU", "1", 1);
  Result<std::vector<float>> on_gpu = train(true);
  ::unsetenv("TESSERA_SIMULATED_GPU");
  ASSERT_OK(on_gpu.status());
  ASSERT_EQ(on_gpu->size(), on_cpu.size());
  for (size_t i = 0; i < on_cpu.size(); ++i) {
    EXPECT_NEAR((*on_gpu)[i], on_cpu[i], 1e-6 * std::abs(on_cpu[i])) << "step " << i + 1;
  }
  EXPECT_LT(on_cpu.back(), on_cpu.front());
}

}  // namespace
}  // namespace tessera::testing
