// What a checkpoint's manifest says the model is (training/checkpoint.h): a model with a
// ModelSpec::config is named by it, a GPT-2 exactly as checkpoints have always named it (so a
// checkpoint saved before the trainer became model-agnostic still loads); a model without one
// by its name and layer groups. Loading compares them field by field.
#include <filesystem>

#include <nlohmann/json.hpp>

#include "model/gpt2.h"
#include "model/model.h"
#include "test_util.h"
#include "training/checkpoint.h"
#include "training/trainer.h"

namespace tessera::testing {
namespace {

TrainingPlan SmallPlan() {
  TrainingPlan plan;
  plan.batch = 2;
  plan.seq_len = 8;
  return plan;
}

nlohmann::json SavedModel(Trainer& trainer, const std::string& name) {
  const std::string dir = TempPath(name);
  std::filesystem::remove_all(dir);
  Result<std::string> saved = SaveCheckpoint(trainer, dir, "");
  EXPECT_TRUE(saved.ok()) << saved.status().ToString();
  if (!saved.ok()) return nullptr;
  return nlohmann::json::parse(ReadFileText(*saved + "/manifest.json")).at("model");
}

TEST(CheckpointTest, AGpt2IsNamedByItsFiveDimensionsAsBefore) {
  const Gpt2Config config{.layers = 1, .channels = 16, .heads = 2, .vocab = 32, .max_seq_len = 8};
  ASSERT_OK_AND_ASSIGN(auto trainer,
                       Trainer::Create(*BuildGpt2(config), SmallPlan(), ExecutorOptions{}));
  ASSERT_OK(trainer->InitializeParameters(1));
  // The manifest's model as every earlier GPT-2 checkpoint wrote it.
  EXPECT_EQ(
      SavedModel(*trainer, "checkpoint_gpt2"),
      nlohmann::json::parse(R"({"channels":16,"heads":2,"layers":1,"max_seq_len":8,"vocab":32})"));
  // Another shape is refused naming the field; the primitive layers load it (same description).
  Gpt2Config wider = config;
  wider.channels = 32;
  ASSERT_OK_AND_ASSIGN(auto other,
                       Trainer::Create(*BuildGpt2(wider), SmallPlan(), ExecutorOptions{}));
  Result<CheckpointInfo> refused = LoadCheckpoint(*other, TempPath("checkpoint_gpt2"));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("channels=16"), std::string::npos)
      << refused.status().ToString();
  ASSERT_OK_AND_ASSIGN(auto primitive,
                       Trainer::Create(*BuildGpt2(config, Gpt2LayerImpl::kPrimitive), SmallPlan(),
                                       ExecutorOptions{}));
  ASSERT_OK(LoadCheckpoint(*primitive, TempPath("checkpoint_gpt2")).status());
  EXPECT_EQ(*primitive->GetParameter("wte"), *trainer->GetParameter("wte"));
}

TEST(CheckpointTest, AModelWithoutAConfigIsNamedByItsLayerGroups) {
  ModelBuilder builder("tiny_mlp", CpuRegistry());
  ModelValue x = builder.Input("x", DType::kF32, Shape{1, 4});
  ModelValue y = builder.Input("y", DType::kI32, Shape{1}, /*label=*/true);
  ModelValue logits = builder.Layer("fc", {x}, [](LayerBuilder& l) {
    LayerValue w = l.Param("w", Shape{3, 4}, ParamInit::Normal(0.1), /*decay=*/true);
    LayerValue b = l.Param("b", Shape{3}, ParamInit::Zeros());
    return l.Call("linear_forward", {l.input(0), w, b});
  });
  builder.Loss("loss", {logits, y}, [](LayerBuilder& l) {
    return l.Call("softmax_cross_entropy", {l.input(0), l.input(1)});
  });
  ASSERT_OK_AND_ASSIGN(ModelSpec model, builder.Build());
  TrainingPlan plan;
  plan.batch = 2;
  ASSERT_OK_AND_ASSIGN(auto trainer, Trainer::Create(model, plan, ExecutorOptions{}));
  ASSERT_OK(trainer->InitializeParameters(1));
  EXPECT_EQ(SavedModel(*trainer, "checkpoint_mlp"),
            nlohmann::json::parse(R"({"name":"tiny_mlp","layer_groups":[
                {"name":"fc","numel":15},{"name":"loss","numel":0}]})"));
}

}  // namespace
}  // namespace tessera::testing
