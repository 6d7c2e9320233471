// my_driver: a driver program written against the installed Tessera SDK (see CMakeLists.txt).
//
// Starts a local cluster of two CPU worker processes (printing which `tessera` binary runs them),
// trains a tiny GPT-2 with ZeRO-2 over them for a few steps on random tokens, prints each step's
// loss and exits 0 (1 on any error).
//
//   my_driver [steps]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "core/status.h"
#include "model/gpt2.h"
#include "training/token_dataset.h"
#include "training/trainer.h"

namespace {

tessera::Status Train(int steps) {
  // The `tessera` binary (scheduler and workers) is found where the SDK was installed.
  const tessera::LocalClusterOptions options{.cpu_workers = 2, .threads_per_worker = 1};
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<tessera::Cluster> cluster,
                           tessera::Cluster::StartLocal(options));
  // Which binary runs the cluster's processes (the scheduler is the first one started).
  std::error_code error;
  std::printf("scheduler: %s\n",
              std::filesystem::read_symlink(
                  "/proc/" + std::to_string(cluster->local_processes().at(0)) + "/exe", error)
                  .c_str());
  TESSERA_ASSIGN_OR_RETURN(
      std::unique_ptr<tessera::GraphBackend> backend,
      tessera::MakeClusterBackend(*cluster, tessera::ClusterPlacement::kScheduler));

  TESSERA_ASSIGN_OR_RETURN(tessera::Gpt2Config config, tessera::Gpt2Config::Preset("tiny"));
  tessera::TrainingPlan plan;
  plan.batch = 4;
  plan.seq_len = config.max_seq_len;
  plan.parallel.data_parallel = 2;  // one rank per worker
  plan.parallel.zero_stage = 2;     // optimizer state and gradients sharded over them
  TESSERA_ASSIGN_OR_RETURN(tessera::ModelSpec model, tessera::BuildGpt2(config));
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<tessera::Trainer> trainer,
                           tessera::Trainer::Create(std::move(model), plan, std::move(backend)));
  TESSERA_RETURN_IF_ERROR(trainer->InitializeParameters(/*seed=*/1));

  const tessera::TokenDataset data =
      tessera::TokenDataset::Synthetic(1 << 16, static_cast<int32_t>(config.vocab), /*seed=*/2);
  TESSERA_ASSIGN_OR_RETURN(tessera::BatchSampler sampler,
                           tessera::BatchSampler::Create(data, plan.batch, plan.seq_len, 3));
  std::vector<int32_t> tokens(static_cast<size_t>(plan.batch * plan.seq_len));
  std::vector<int32_t> targets(tokens.size());
  std::printf("%s on %s\n", config.ToString().c_str(), trainer->backend().Describe().c_str());
  for (int step = 1; step <= steps; ++step) {
    sampler.Next(tokens.data(), targets.data());
    TESSERA_ASSIGN_OR_RETURN(std::vector<tessera::Tensor> batch,
                             tessera::Gpt2Batch(config, tokens, targets, plan.batch, plan.seq_len));
    TESSERA_ASSIGN_OR_RETURN(tessera::StepReport report, trainer->Step(batch, 1e-3f));
    if (!std::isfinite(report.loss)) {
      return tessera::Internal("step {}: the loss is {}", step, report.loss);
    }
    std::printf("step %d loss %.4f\n", step, report.loss);
  }
  return tessera::Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 5;
  if (const tessera::Status status = Train(steps); !status.ok()) {
    std::fprintf(stderr, "my_driver: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
