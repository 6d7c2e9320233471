// Shape mismatches are reported with the op, the layer and both shapes, before anything runs.
#include "model/gpt2.h"
#include "ops/graph_builder.h"
#include "test_util.h"
#include "training/trainer.h"

namespace tessera::testing {
namespace {

TensorMeta F32(Shape shape) { return {std::move(shape), DType::kF32, Device::Cpu()}; }

void ExpectAll(const Status& status, std::initializer_list<const char*> parts) {
  ASSERT_FALSE(status.ok());
  for (const char* part : parts) {
    EXPECT_NE(status.message().find(part), std::string::npos)
        << "'" << part << "' missing from: " << status.message();
  }
}

TEST(ShapeErrorTest, BlockInputWithTheWrongWidthNamesOpLayerAndShapes) {
  GraphBuilder builder(CpuRegistry());
  ObjectId x = builder.AddInput("x", F32({4, 64, 128}), ObjectRole::kActivation);
  ObjectId params = builder.AddInput("p", F32({12 * 256 * 256 + 13 * 256}), ObjectRole::kParameter);
  TaskOptions options;
  options.layer = "h.2";
  Result<std::vector<ObjectId>> out =
      builder.AddTask("h.2/forward", "transformer_block_forward", {x, params},
                      Attrs{{"channels", int64_t{256}}, {"heads", int64_t{4}}}, options);
  ExpectAll(out.status(),
            {"transformer_block_forward", "layer h.2", "[4, 64, 128]", "[B, T, 256]"});
  EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument);
}

TEST(ShapeErrorTest, ReadingAnObjectOnAnotherDeviceNeedsACopyTask) {
  // A host-tier object read by a GPU task is refused (naming both devices and the fix); a copy
  // task moves it, and its output lives where the copy ran.
  GraphBuilder builder(CpuRegistry());
  ObjectId host = builder.AddInput("h.0.grad.host", F32({16}), ObjectRole::kGradient);
  TaskOptions on_gpu;
  on_gpu.layer = "h.0";
  on_gpu.device_kind = DeviceKind::kCuda;
  Result<std::vector<ObjectId>> direct =
      builder.AddTask("h.0/grad_norm", "sum_of_squares", {host}, {}, on_gpu);
  ExpectAll(direct.status(),
            {"h.0/grad_norm", "runs on cuda", "'h.0.grad.host' lives on cpu", "'copy' task"});
  ASSERT_OK_AND_ASSIGN(auto copied, builder.AddTask("h.0/to_device", "copy", {host}, {}, on_gpu));
  EXPECT_EQ(builder.meta(copied[0]).device, Device::Cuda(0));
  ASSERT_OK_AND_ASSIGN(auto norm,
                       builder.AddTask("h.0/grad_norm", "sum_of_squares", {copied[0]}, {}, on_gpu));
  EXPECT_EQ(builder.meta(norm[0]).device, Device::Cuda(0));
}

TEST(ShapeErrorTest, LinearWeightMismatchNamesBothShapes) {
  GraphBuilder builder(CpuRegistry());
  ObjectId x = builder.AddInput("x", F32({2, 8}), ObjectRole::kActivation);
  ObjectId w = builder.AddInput("w", F32({12, 9}), ObjectRole::kParameter);
  ObjectId b = builder.AddInput("b", F32({12}), ObjectRole::kParameter);
  TaskOptions options;
  options.layer = "mlp";
  Result<std::vector<ObjectId>> out =
      builder.AddTask("mlp/fc", "linear_forward", {x, w, b}, {}, options);
  ExpectAll(out.status(), {"linear_forward", "layer mlp", "[12, 9]", "[2, 8]"});
}

TEST(ShapeErrorTest, WrongParameterGroupSizeNamesTheExpectedSize) {
  GraphBuilder builder(CpuRegistry());
  ObjectId x = builder.AddInput("x", F32({1, 4, 16}), ObjectRole::kActivation);
  ObjectId params = builder.AddInput("p", F32({100}), ObjectRole::kParameter);
  Result<std::vector<ObjectId>> out = builder.AddTask(
      "h.0/forward", "transformer_block_forward", {x, params},
      Attrs{{"channels", int64_t{16}}, {"heads", int64_t{2}}}, TaskOptions{.layer = "h.0"});
  ExpectAll(out.status(),
            {"transformer_block_forward", "layer h.0", "'params'", "[100]", "[3280]"});
}

TEST(ShapeErrorTest, SettingAParameterOfTheWrongShapeNamesItAndBothShapes) {
  auto trainer = *Trainer::Create(*BuildGpt2(Gpt2Config{1, 16, 2, 20, 8}), TrainingPlan{2, 8, {}},
                                  ExecutorOptions{});
  Status status =
      trainer->SetParameter("h.0.fc_w", std::vector<float>(size_t{16} * 16), Shape{16, 16});
  ExpectAll(status, {"h.0.fc_w", "[64, 16]", "[16, 16]"});
  ExpectAll(trainer->SetParameter("h.7.fc_w", {}, Shape{0}), {"no parameter named 'h.7.fc_w'"});
}

}  // namespace
}  // namespace tessera::testing
