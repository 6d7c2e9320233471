// GPU worker processes (tessera worker --gpu N) as a user meets them: train_gpt2 --device cuda
// --workers N starts a local cluster of N GPU workers and trains on them. Against the same run on
// the driver's own GPU (in process), the losses must agree:
//   - one GPU worker runs the very same plan and kernels: 1e-5 relative (the data path differs:
//     the batch travels to the worker, the loss back; the arithmetic does not);
//   - two GPU workers (data parallel, ZeRO-1, -2 and -3; both on GPU 0 where the machine has
//     one) sum their gradients through host copies over the UCX communicator, in another order
//     than one rank's backward does. On a real GPU with bf16 activations: 1e-2 relative per
//     run's final loss, as cuda_gpt2_test allows between the GPU and the CPU; on the simulated
//     GPU (f32, the CPU kernels) 1e-5, as the CPU plans allow each other. One GPU worker with its
//     optimizer offloaded to its host (ZeRO-Offload), its parameters too (in process, on one
//     worker, and ZeRO-3 on two: each layer's copied up for each use), and two as pipeline
//     stages (activations and their gradients pushed between them from host copies), are held
//     to the same tolerance.
// Built twice from this file: gpu_workers_test (label gpu: a real GPU; skips without one) and
// simulated_gpu_workers_test (label integration: TESSERA_SIMULATED_GPU=1, worker/simulated_gpu.h,
// whose device memory is scrambled host memory, so a host read of a device buffer gives wrong
// losses here where a real GPU crashes). A failed run prints the tails of its workers' logs.
//
// Status: in the first GPU run (2026-11-26, H200) every run on GPU workers failed at step 1 with
// the worker process gone ("died while running its part of graph"); the logs that would say why
// were not kept then, which is why this test prints them now.
#include <stdlib.h>

#include <filesystem>
#include <regex>
#include <string>

#include "core/cuda_device.h"
#include "launcher/session.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

constexpr const char* kRun =
    "--preset tiny --device cuda --steps 8 --batch 8 --seq-len 64 --log-every 1 --data synthetic "
    "--seed 3 --threads 2";

double FinalLoss(const std::string& output) {
  std::smatch match;
  if (!std::regex_search(output, match, std::regex(R"(summary: steps=8 .*final_loss=([0-9.]+))"))) {
    return -1;
  }
  return std::stod(match[1]);
}

// The last lines of every worker log of the newest local cluster session (why a worker died).
std::string WorkerLogs() {
  std::filesystem::path newest;
  std::filesystem::file_time_type newest_time;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(SessionRoot(""), error)) {
    if (!entry.is_directory() || entry.path().filename().string().rfind("local_", 0) != 0) continue;
    if (newest.empty() || entry.last_write_time() > newest_time) {
      newest = entry.path();
      newest_time = entry.last_write_time();
    }
  }
  std::string logs;
  if (newest.empty()) return logs;
  for (const auto& entry : std::filesystem::directory_iterator(newest, error)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("worker-", 0) != 0) continue;
    const std::string text = ReadFileText(entry.path().string());
    logs += "\n== " + entry.path().string() + " (last 3000 bytes)\n" +
            text.substr(text.size() > 3000 ? text.size() - 3000 : 0);
  }
  return logs;
}

#if TESSERA_SIMULATED_GPU_TEST
constexpr double kDataParallelTolerance = 1e-5;
#else
constexpr double kDataParallelTolerance = 1e-2;
#endif

class GpuWorkersTest : public ::testing::Test {
 protected:
  void SetUp() override {
#if TESSERA_SIMULATED_GPU_TEST
    ::setenv("TESSERA_SIMULATED_GPU", "1", 1);  // inherited by train_gpt2 and its workers
#else
    const CudaDevices probe = ProbeCudaDevices();
    if (probe.devices.empty()) GTEST_SKIP() << "no usable CUDA device: " << probe.reason;
#endif
  }
  static double Train(const std::string& extra) {
    const ProcessResult run = RunBinary("train_gpt2", std::string(kRun) + " " + extra);
    EXPECT_EQ(run.exit_code, 0) << run.output << WorkerLogs();
    const double loss = FinalLoss(run.output);
    EXPECT_GT(loss, 0) << run.output;
    std::printf("train_gpt2 %s: final loss %.6f\n", extra.c_str(), loss);
    return loss;
  }
};

TEST_F(GpuWorkersTest, OneGpuWorkerTrainsLikeTheDriversOwnGpu) {
  const double in_process = Train("");
  const double one_worker = Train("--workers 1");
  EXPECT_NEAR(one_worker, in_process, 1e-5 * in_process);
}

TEST_F(GpuWorkersTest, GpuWorkersTrainDataParallelZeroOffloadedAndPipelined) {
  const double in_process = Train("");
  for (const std::string plan :
       {"--workers 2", "--workers 2 --zero-stage 1", "--workers 2 --zero-stage 2",
        "--workers 2 --zero-stage 3", "--workers 1 --offload optimizer",
        "--workers 2 --pipeline-stages 2 --micro-batches 2", "--offload parameters",
        "--workers 1 --offload parameters", "--workers 2 --zero-stage 3 --offload parameters"}) {
    const double loss = Train(plan);
    EXPECT_NEAR(loss, in_process, kDataParallelTolerance * in_process) << plan;
  }
}

}  // namespace
}  // namespace tessera::testing
