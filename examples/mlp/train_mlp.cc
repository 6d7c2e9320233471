// The smallest Tessera driver: define an MLP with the model API, train it with ZeRO-2 on a local
// cluster of two worker processes, print the loss. Data: points around one centre per class.
#include <cstdio>
#include <random>

#include "client/cluster.h"
#include "model/model.h"
#include "ops/cpu/cpu_kernels.h"
#include "training/trainer.h"

using namespace tessera;

int main() {
  Result<OpRegistry> registry = MakeCpuOpRegistry();
  ModelBuilder mlp("mlp", *registry);
  ModelValue x = mlp.Input("x", DType::kF32, Shape{1, 32});
  ModelValue y = mlp.Input("y", DType::kI32, Shape{1}, /*label=*/true);
  auto dense = [](int64_t in, int64_t out, bool gelu) {
    return [=](LayerBuilder& l) {
      LayerValue w = l.Param("w", Shape{out, in}, ParamInit::Normal(0.1), /*decay=*/true);
      LayerValue b = l.Param("b", Shape{out}, ParamInit::Zeros());
      LayerValue h = l.Call("linear_forward", {l.input(0), w, b});
      return gelu ? l.Call("gelu_forward", {h}) : h;
    };
  };
  ModelValue h = mlp.Layer("fc1", {x}, dense(32, 64, true));
  ModelValue logits = mlp.Layer("fc2", {h}, dense(64, 8, false));
  mlp.Loss("loss", {logits, y}, [](LayerBuilder& l) {
    return l.Call("softmax_cross_entropy", {l.input(0), l.input(1)});
  });
  Result<ModelSpec> model = mlp.Build();
  Result<std::unique_ptr<Cluster>> cluster = Cluster::StartLocal({.cpu_workers = 2});
  if (!model.ok() || !cluster.ok()) {
    std::fprintf(stderr, "%s\n",
                 (model.ok() ? cluster.status() : model.status()).ToString().c_str());
    return 1;
  }
  TrainingPlan plan{.batch = 64, .parallel = {.data_parallel = 2, .zero_stage = 2}};
  auto trainer = Trainer::Create(*model, plan, *MakeClusterBackend(**cluster));
  if (!trainer.ok() || !(*trainer)->InitializeParameters(1).ok()) {
    std::fprintf(stderr, "%s\n", trainer.status().ToString().c_str());
    return 1;
  }
  std::mt19937 rng(0);
  std::normal_distribution<float> noise(0.0f, 0.7f);
  for (int step = 1; step <= 100; ++step) {
    std::vector<float> points(64 * 32);
    std::vector<int32_t> labels(64);
    for (int i = 0; i < 64; ++i) {
      labels[i] = static_cast<int32_t>(rng() % 8);
      for (int f = 0; f < 32; ++f) points[i * 32 + f] = (f % 8 == labels[i]) + noise(rng);
    }
    Result<StepReport> report = (*trainer)->Step(
        {*Tensor::FromVector(Shape{64, 32}, points), *Tensor::FromVector(Shape{64}, labels)},
        3e-3f);
    if (!report.ok()) return std::fprintf(stderr, "%s\n", report.status().ToString().c_str()), 1;
    if (step % 10 == 0) std::printf("step %d loss %.4f\n", step, report->loss);
  }
  return 0;
}
