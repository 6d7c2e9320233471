// The smallest Tessera driver: define an MLP with the model API, train it with ZeRO-2 on a local
// cluster of two worker processes, print the loss. Data: points around one centre per class.
// The plan and cluster flags are the other examples' (examples/common): e.g. --workers 4
// --zero-stage 3, --in-process, or --address HOST:PORT. The hidden layer's activation is any op of
// one input (--activation), a plugin's too: --plugin libmy_ops.so --activation softsign_forward
// (examples/plugin/).
#include <cstdio>
#include <exception>
#include <random>
#include <string>

#include "core/run_main.h"
#include "examples/common/flags.h"
#include "examples/common/session.h"
#include "model/model.h"
#include "ops/cpu/cpu_kernels.h"
#include "training/trainer.h"

using namespace tessera;

namespace {

Result<ModelSpec> Mlp(const OpRegistry& registry, const std::string& activation) {
  ModelBuilder mlp("mlp", registry);
  ModelValue x = mlp.Input("x", DType::kF32, Shape{1, 32});
  ModelValue y = mlp.Input("y", DType::kI32, Shape{1}, /*label=*/true);
  auto dense = [&activation](int64_t in, int64_t out, bool activate) {
    return [=](LayerBuilder& l) {
      LayerValue w = l.Param("w", Shape{out, in}, ParamInit::Normal(0.1), /*decay=*/true);
      LayerValue b = l.Param("b", Shape{out}, ParamInit::Zeros());
      LayerValue h = l.Call("linear_forward", {l.input(0), w, b});
      return activate ? l.Call(activation, {h}) : h;
    };
  };
  ModelValue h = mlp.Layer("fc1", {x}, dense(32, 64, true));
  ModelValue logits = mlp.Layer("fc2", {h}, dense(64, 8, false));
  mlp.Loss("loss", {logits, y}, [](LayerBuilder& l) {
    return l.Call("softmax_cross_entropy", {l.input(0), l.input(1)});
  });
  return mlp.Build();
}

// A batch of 64 points, each near the centre of its class (one of 8).
std::vector<Tensor> Points(std::mt19937& rng, std::normal_distribution<float>& noise) {
  std::vector<float> points(size_t{64} * 32);
  std::vector<int32_t> labels(64);
  for (int i = 0; i < 64; ++i) {
    labels[i] = static_cast<int32_t>(rng() % 8);
    for (int f = 0; f < 32; ++f) points[i * 32 + f] = (f % 8 == labels[i]) + noise(rng);
  }
  return {*Tensor::FromVector(Shape{64, 32}, points), *Tensor::FromVector(Shape{64}, labels)};
}

Status Train(const examples::CommonFlags& flags, const std::string& activation) {
  // After ParseFlags, which loaded the plugins: the registry holds their ops too.
  TESSERA_ASSIGN_OR_RETURN(OpRegistry registry, MakeCpuOpRegistry());
  TESSERA_ASSIGN_OR_RETURN(ModelSpec model, Mlp(registry, activation));
  // The plan and where it runs: the flags every example shares (examples/common).
  TESSERA_ASSIGN_OR_RETURN(examples::Runtime runtime, examples::OpenRuntime(flags));
  TrainingPlan plan{.batch = 64};
  TESSERA_RETURN_IF_ERROR(examples::ApplyPlanFlags(flags, "train_mlp", plan));
  TESSERA_ASSIGN_OR_RETURN(auto session, examples::Session::Open(flags, runtime, "train_mlp"));
  TESSERA_RETURN_IF_ERROR(
      examples::UseTheClustersWorkers(flags, *session, model, runtime, "train_mlp", plan));
  TESSERA_RETURN_IF_ERROR(
      examples::ChooseThePlan(flags, *session, model, runtime, "train_mlp", plan));
  TESSERA_ASSIGN_OR_RETURN(auto backend, session->MakeBackend());
  TESSERA_ASSIGN_OR_RETURN(auto trainer, Trainer::Create(model, plan, std::move(backend)));
  TESSERA_RETURN_IF_ERROR(trainer->InitializeParameters(1));
  std::mt19937 rng(0);
  std::normal_distribution<float> noise(0.0f, 0.7f);
  for (int step = 1; step <= 100; ++step) {
    TESSERA_ASSIGN_OR_RETURN(StepReport report, trainer->Step(Points(rng, noise), 3e-3f));
    if (step % 10 == 0) std::printf("step %d loss %.4f\n", step, report.loss);
  }
  return Status::Ok();
}

// The program. main() reports an exception that escapes it (memory running out, a bug) as an
// error instead of terminating.
int Main(int argc, char** argv) {
  examples::CommonFlags flags{.workers = 2, .zero_stage = 2};
  CLI::App app{"Train an MLP (the model API) with ZeRO-2 on a local cluster of two workers"};
  examples::AddThreadsFlag(app, flags);
  examples::AddPlanFlags(app, flags);
  examples::AddClusterFlags(app, flags);
  examples::AddPluginFlag(app, flags);
  std::string activation = "gelu_forward";
  app.add_option("--activation", activation,
                 "The hidden layer's activation: an op of one input and output of its shape, "
                 "built in (gelu_forward) or a --plugin's")
      ->capture_default_str();
  if (std::optional<int> exit = examples::ParseFlags(app, argc, argv, "train_mlp", flags)) {
    return *exit;
  }
  if (flags.in_process) flags.workers = 0;  // the default here is a cluster
  if (Status status = Train(flags, activation); !status.ok()) {
    std::fprintf(stderr, "train_mlp: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::RunMain("train_mlp", [&] { return Main(argc, argv); });
}
