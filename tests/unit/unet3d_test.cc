// The 3D U-Net (model/unet3d.h) and its procedural data (data/volumes.h): the model builds in
// topological order with its skip connections, has the parameters a hand count gives, every
// layer's derived backward agrees with finite differences, the planner makes a step of it, and
// wrong configs are refused naming the field. The volumes are deterministic, labelled in range,
// hold every class, and their intensities separate the classes on average.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <tuple>

#include <fmt/format.h>
#include <gmock/gmock.h>

#include "data/volumes.h"
#include "layer_gradient_check.h"
#include "model/unet3d.h"
#include "ops/cpu/volume_kernels.h"
#include "ops/layer_program.h"
#include "ops/standard_ops.h"
#include "planner/step_graph.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using Tensors = std::vector<Tensor>;
using ::testing::HasSubstr;

std::vector<std::string> LayerNames(const ModelSpec& model) {
  std::vector<std::string> names;
  names.reserve(model.layers.size());
  for (const LayerSpec& layer : model.layers) names.push_back(layer.name);
  return names;
}

void ExpectBitIdentical(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.meta(), b.meta()) << what;
  EXPECT_EQ(std::memcmp(a.raw_data(), b.raw_data(), static_cast<size_t>(a.bytes())), 0) << what;
}

size_t LayerIndex(const ModelSpec& model, const std::string& name) {
  for (size_t i = 0; i < model.layers.size(); ++i) {
    if (model.layers[i].name == name) return i;
  }
  ADD_FAILURE() << "no layer " << name;
  return model.layers.size();
}

TEST(UNet3dConfigTest, PresetsAreValidAndUnknownOnesAreNotFound) {
  ASSERT_OK_AND_ASSIGN(UNet3dConfig tiny, UNet3dConfig::Preset("tiny"));
  EXPECT_EQ(tiny.base_channels, 4);
  EXPECT_EQ(tiny.depth, 1);
  EXPECT_EQ(tiny.volume, 8);
  EXPECT_OK(tiny.Validate());
  ASSERT_OK_AND_ASSIGN(UNet3dConfig small, UNet3dConfig::Preset("small"));
  EXPECT_EQ(small.base_channels, 8);
  EXPECT_EQ(small.depth, 2);
  EXPECT_EQ(small.volume, 16);
  EXPECT_OK(small.Validate());
  EXPECT_EQ(small.ToString(), "in_channels=1 classes=3 base_channels=8 depth=2 groups=4 volume=16");
  Result<UNet3dConfig> unknown = UNet3dConfig::Preset("huge");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find("tiny, small or nnunet"), std::string::npos);
  ASSERT_OK_AND_ASSIGN(UNet3dConfig nnunet, UNet3dConfig::Preset("nnunet"));
  EXPECT_OK(nnunet.Validate());
  EXPECT_EQ(nnunet.ToString(),
            "in_channels=1 classes=3 base_channels=32 depth=5 groups=4 volume=128 "
            "max_channels=320 norm=instance activation=leaky_relu downsample=strided_conv");
  const std::vector<int64_t> expected = {32, 64, 128, 256, 320, 320};
  for (int64_t level = 0; level <= 5; ++level) {
    EXPECT_EQ(nnunet.Channels(level), expected[static_cast<size_t>(level)]) << level;
  }
}

TEST(UNet3dConfigTest, AWrongConfigIsRefusedNamingTheField) {
  struct Case {
    UNet3dConfig config;
    std::string field;
  };
  const std::vector<Case> cases = {
      {UNet3dConfig{.depth = 2, .volume = 10}, "volume (10) must be divisible by 2^depth = 4"},
      {UNet3dConfig{.depth = 3, .volume = 20}, "volume (20) must be divisible by 2^depth = 8"},
      {UNet3dConfig{.base_channels = 6, .groups = 4}, "groups (4) must divide base_channels (6)"},
      {UNet3dConfig{.classes = 1}, "classes"},
      {UNet3dConfig{.in_channels = 0}, "in_channels"},
      {UNet3dConfig{.depth = 0}, "depth"},
      {UNet3dConfig{.groups = 0}, "groups"},
      {UNet3dConfig{.depth = 9, .volume = 512}, "depth must be <= 8"},
      {UNet3dConfig{.base_channels = int64_t{1} << 40}, "base_channels"},
      {UNet3dConfig{.base_channels = 8, .max_channels = 4}, "max_channels (4) must be at least"},
      {UNet3dConfig{.base_channels = 8, .groups = 4, .max_channels = 10},
       "groups (4) must divide max_channels (10)"},
      {UNet3dConfig{.depth = 2, .deep_supervision = true}, "deep supervision needs depth >= 3"},
      {UNet3dConfig{.activations = DType::kI32}, "activations must be f32 or bf16, got i32"},
  };
  for (const Case& c : cases) {
    const Status status = c.config.Validate();
    ASSERT_FALSE(status.ok()) << c.config.ToString();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find(c.field), std::string::npos) << status.ToString();
    // Building refuses it with the same message.
    Result<ModelSpec> built = BuildUNet3d(c.config, CpuRegistry());
    ASSERT_FALSE(built.ok());
    EXPECT_EQ(built.status().ToString(), status.ToString());
  }
}

// bf16 activations: the volume stays an f32 input and the first layer casts it; a split into
// slabs (f32 only) is refused naming the fix, while a tensor-parallel split keeps bf16.
TEST(UNet3dTest, Bf16ActivationsCastTheVolumeAndSlabsAreRefused) {
  UNet3dConfig config = *UNet3dConfig::Preset("tiny");
  config.activations = DType::kBF16;
  EXPECT_EQ(config.ToString(), UNet3dConfig::Preset("tiny")->ToString());  // checkpoints alike
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(config, CpuRegistry()));
  ASSERT_EQ(model.inputs.size(), 2u);
  EXPECT_EQ(model.inputs[0].dtype, DType::kF32);
  ASSERT_OK_AND_ASSIGN(ModelSpec f32_model,
                       BuildUNet3d(*UNet3dConfig::Preset("tiny"), CpuRegistry()));
  EXPECT_EQ(model.NumParameters(), f32_model.NumParameters());
  Result<ModelSpec> slabs = model.SplitForSequenceParallel(2, SequenceAttention::kHalo);
  ASSERT_FALSE(slabs.ok());
  EXPECT_NE(slabs.status().message().find("use --activations f32 with --spatial-parallel"),
            std::string::npos)
      << slabs.status().ToString();
  EXPECT_OK(model.SplitForTensorParallel(2).status());
}

TEST(UNet3dTest, TheTinyUNetBuildsInTopologicalOrderWithSkipConnections) {
  ASSERT_OK_AND_ASSIGN(UNet3dConfig config, UNet3dConfig::Preset("tiny"));
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(config, CpuRegistry()));
  EXPECT_OK(model.Validate());
  EXPECT_EQ(model.name, "unet3d");
  EXPECT_EQ(LayerNames(model), (std::vector<std::string>{"enc0", "down0", "bottleneck", "up0",
                                                         "dec0", "head", "loss"}));
  ASSERT_EQ(model.inputs.size(), 2u);
  EXPECT_EQ(model.inputs[0].name, "volume");
  EXPECT_EQ(model.inputs[0].dtype, DType::kF32);
  EXPECT_EQ(model.inputs[0].shape, (Shape{1, 1, 8, 8, 8}));
  EXPECT_FALSE(model.inputs[0].label);
  EXPECT_EQ(model.inputs[1].name, "labels");
  EXPECT_EQ(model.inputs[1].dtype, DType::kI32);
  EXPECT_EQ(model.inputs[1].shape, (Shape{1, 8, 8, 8}));
  EXPECT_TRUE(model.inputs[1].label);

  // Every activation argument names an earlier layer.
  for (size_t l = 0; l < model.layers.size(); ++l) {
    for (const LayerArg& arg : model.layers[l].forward_args) {
      if (arg.kind == LayerArg::Kind::kActivation) {
        EXPECT_LT(arg.index, l) << model.layers[l].name;
      }
      if (arg.kind == LayerArg::Kind::kParams) {
        EXPECT_EQ(arg.index, l) << model.layers[l].name;
      }
    }
  }
  // The skip connection: dec0 reads up0's output, then enc0's, then its parameters, and returns
  // gradients for both activations and its parameters.
  const LayerSpec& dec0 = model.layers[LayerIndex(model, "dec0")];
  ASSERT_EQ(dec0.forward_args.size(), 3u);
  EXPECT_EQ(dec0.forward_args[0].kind, LayerArg::Kind::kActivation);
  EXPECT_EQ(dec0.forward_args[0].index, LayerIndex(model, "up0"));
  EXPECT_EQ(dec0.forward_args[1].kind, LayerArg::Kind::kActivation);
  EXPECT_EQ(dec0.forward_args[1].index, LayerIndex(model, "enc0"));
  EXPECT_EQ(dec0.forward_args[2].kind, LayerArg::Kind::kParams);
  EXPECT_EQ(dec0.backward_outputs, (std::vector<size_t>{0, 1, 2}));
  // enc0 reads the model input: no gradient for it, only for its parameters.
  const LayerSpec& enc0 = model.layers[LayerIndex(model, "enc0")];
  EXPECT_EQ(enc0.forward_args[0].kind, LayerArg::Kind::kModelInput);
  EXPECT_EQ(enc0.backward_outputs, (std::vector<size_t>{1}));
  // The pooling layer has no parameters: no group argument, a gradient for its input only.
  const LayerSpec& down0 = model.layers[LayerIndex(model, "down0")];
  EXPECT_EQ(down0.params.numel(), 0);
  ASSERT_EQ(down0.forward_args.size(), 1u);
  EXPECT_EQ(down0.backward_outputs, (std::vector<size_t>{0}));
  // The loss reads the head's logits and the labels.
  const LayerSpec& loss = model.layers.back();
  EXPECT_TRUE(loss.loss);
  ASSERT_EQ(loss.forward_args.size(), 2u);
  EXPECT_EQ(loss.forward_args[0].index, LayerIndex(model, "head"));
  EXPECT_EQ(loss.forward_args[1].kind, LayerArg::Kind::kModelInput);
  EXPECT_EQ(loss.forward_args[1].index, 1u);
}

TEST(UNet3dTest, TwoLevelsChainTheDecodersAndSkipToTheirOwnLevel) {
  ASSERT_OK_AND_ASSIGN(UNet3dConfig config, UNet3dConfig::Preset("small"));
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(config, CpuRegistry()));
  EXPECT_EQ(LayerNames(model),
            (std::vector<std::string>{"enc0", "down0", "enc1", "down1", "bottleneck", "up1", "dec1",
                                      "up0", "dec0", "head", "loss"}));
  const LayerSpec& dec1 = model.layers[LayerIndex(model, "dec1")];
  EXPECT_EQ(dec1.forward_args[1].index, LayerIndex(model, "enc1"));
  const LayerSpec& up0 = model.layers[LayerIndex(model, "up0")];
  EXPECT_EQ(up0.forward_args[0].index, LayerIndex(model, "dec1"));
  const LayerSpec& dec0 = model.layers[LayerIndex(model, "dec0")];
  EXPECT_EQ(dec0.forward_args[1].index, LayerIndex(model, "enc0"));
}

TEST(UNet3dTest, TheTinyUNetHasTheParametersAHandCountGives) {
  ASSERT_OK_AND_ASSIGN(UNet3dConfig config, UNet3dConfig::Preset("tiny"));
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(config, CpuRegistry()));
  // A conv block: conv weight out*in*27 + bias out, group norm weight and bias 2*out.
  auto block = [](int64_t in, int64_t out) { return out * in * 27 + out + 2 * out; };
  const int64_t enc0 = block(1, 4) + block(4, 4);        // 564
  const int64_t bottleneck = block(4, 8) + block(8, 8);  // 2640
  const int64_t up0 = 8 * 4 * 8 + 4;                     // 260: [Cin, Cout, 2, 2, 2] + bias
  const int64_t dec0 = block(8, 4) + block(4, 4);        // 1320: concat of 4 + 4 channels
  const int64_t head = 3 * 4 + 3;                        // 15
  EXPECT_EQ(model.layers[LayerIndex(model, "enc0")].params.numel(), enc0);
  EXPECT_EQ(model.layers[LayerIndex(model, "down0")].params.numel(), 0);
  EXPECT_EQ(model.layers[LayerIndex(model, "bottleneck")].params.numel(), bottleneck);
  EXPECT_EQ(model.layers[LayerIndex(model, "up0")].params.numel(), up0);
  EXPECT_EQ(model.layers[LayerIndex(model, "dec0")].params.numel(), dec0);
  EXPECT_EQ(model.layers[LayerIndex(model, "head")].params.numel(), head);
  EXPECT_EQ(model.layers.back().params.numel(), 0);
  EXPECT_EQ(model.NumParameters(), 4799);
  EXPECT_EQ(model.NumParameters(), enc0 + bottleneck + up0 + dec0 + head);
}

TEST(UNet3dTest, ParametersStartKaimingNormalWithDecayOnConvWeightsOnly) {
  ASSERT_OK_AND_ASSIGN(UNet3dConfig config, UNet3dConfig::Preset("tiny"));
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(config, CpuRegistry()));
  for (const LayerSpec& layer : model.layers) {
    ASSERT_EQ(layer.init.size(), layer.params.slots().size()) << layer.name;
    for (size_t s = 0; s < layer.init.size(); ++s) {
      const FlatSlot& slot = layer.params.slots()[s];
      const ParamInit& init = layer.init[s];
      const std::string name = layer.name + "." + slot.name;
      if (slot.shape.rank() == 5) {
        // conv3d [Cout, Cin, k, k, k]: fan_in Cin*k^3; the transposed conv [Cin, Cout, 2, 2, 2]
        // sums Cin products per output voxel.
        const bool transposed = layer.name.starts_with("up");
        const int64_t fan_in = transposed
                                   ? slot.shape[0]
                                   : slot.shape[1] * slot.shape[2] * slot.shape[3] * slot.shape[4];
        EXPECT_EQ(init.kind, ParamInit::Kind::kNormal) << name;
        EXPECT_DOUBLE_EQ(init.scale, std::sqrt(2.0 / static_cast<double>(fan_in))) << name;
        EXPECT_TRUE(slot.weight_decay) << name;
      } else {
        const bool gain = slot.name.starts_with("norm") && slot.name.ends_with(".w");
        EXPECT_EQ(init.kind, gain ? ParamInit::Kind::kOnes : ParamInit::Kind::kZeros) << name;
        EXPECT_FALSE(slot.weight_decay) << name;
      }
    }
  }
  ASSERT_OK_AND_ASSIGN(const LayerSpec* enc0, model.FindLayer("enc0"));
  EXPECT_EQ(enc0->params.slot("conv1.w").shape, (Shape{4, 1, 3, 3, 3}));
  EXPECT_EQ(enc0->params.slot("norm2.b").shape, (Shape{4}));
}

// The planner makes a training step of the U-Net, parameter-less layers included: one rank,
// and two ranks under ZeRO-3 (each group sharded, the pooling layers holding none).
TEST(UNet3dTest, ThePlannerMakesATrainingStepOfIt) {
  ASSERT_OK_AND_ASSIGN(UNet3dConfig config, UNet3dConfig::Preset("tiny"));
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(config, CpuRegistry()));
  TrainingPlan plan;
  plan.batch = 2;
  plan.seq_len = 1;
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
  EXPECT_OK(step.graph.Validate());
  ASSERT_EQ(step.group_numel.size(), model.layers.size());
  EXPECT_EQ(step.group_numel[LayerIndex(model, "down0")], 0);
  ASSERT_EQ(step.inputs.size(), 2u);

  plan.parallel.data_parallel = 2;
  plan.parallel.zero_stage = 3;
  plan.parallel.workers = {WorkerId(10), WorkerId(11)};
  ASSERT_OK_AND_ASSIGN(StepGraph zero3, PlanTrainingStep(model, plan, CpuRegistry()));
  EXPECT_OK(zero3.graph.Validate());
  EXPECT_EQ(zero3.micro_batch_rows, 1);

  ASSERT_OK_AND_ASSIGN(ForwardGraph eval, PlanEvalLoss(model, 2, 1, CpuRegistry()));
  EXPECT_OK(eval.graph.Validate());
}

// Runs a layer's forward then its derived backward on random data and checks every gradient
// (the layer's f32 inputs and its parameter group) against central differences of
// L = <G, outputs> (or the loss itself for the loss layer), as model_api_test does.
class UNet3dGradientTest : public ::testing::Test {
 protected:
  static Tensors Forward(const LayerSpec& layer, const Tensors& args) {
    Result<Tensors> out = RunKernel(layer.forward_op, args, layer.attrs);
    TESSERA_CHECK(out.ok(), "{}", out.status().ToString());
    return *out;
  }
  static void Check(const LayerSpec& layer, Tensors args) {
    ExpectLayerGradientsMatchFiniteDifferences(layer, std::move(args));
  }

  // Distinct values 0.05 apart in random order: no two elements of a pooling window are within
  // the finite-difference step of each other, so the maximum never changes under it.
  static Tensor DistinctTensor(const Shape& shape, uint64_t seed) {
    std::vector<float> values(static_cast<size_t>(shape.numel()));
    std::iota(values.begin(), values.end(), 0.0f);
    std::shuffle(values.begin(), values.end(), std::mt19937_64(seed));
    const float middle = static_cast<float>(values.size()) / 2;
    for (float& v : values) v = (v - middle) * 0.05f;
    return FloatTensor(shape, values);
  }

  // Random arguments of every layer of `model` at the shapes they have in it (the outputs of
  // the layers or model inputs they read, batch kBatch); `shapes`: each layer's output 0.
  static constexpr int64_t kBatch = 2;
  static std::vector<Tensors> ArgsOfEveryLayer(const ModelSpec& model,
                                               std::vector<Shape>* shapes = nullptr) {
    std::vector<Shape> output_shape(model.layers.size());
    std::vector<Tensors> every;
    uint64_t seed = 1;
    for (size_t l = 0; l < model.layers.size(); ++l) {
      const LayerSpec& layer = model.layers[l];
      Tensors args;
      for (const LayerArg& arg : layer.forward_args) {
        switch (arg.kind) {
          case LayerArg::Kind::kModelInput: {
            std::vector<int64_t> dims = model.inputs[arg.index].shape.dims();
            dims[0] = kBatch;
            args.push_back(model.inputs[arg.index].dtype == DType::kI32
                               ? RandomTokens(Shape(dims), 3, seed++)
                               : RandomTensor(Shape(dims), seed++));
            break;
          }
          case LayerArg::Kind::kActivation: {
            const Shape& shape = output_shape[arg.index];
            args.push_back(layer.name.starts_with("down") ? DistinctTensor(shape, seed++)
                                                          : RandomTensor(shape, seed++));
            break;
          }
          case LayerArg::Kind::kParams:
            args.push_back(RandomTensor(Shape{layer.params.numel()}, seed++, 0.5f));
            break;
        }
      }
      output_shape[l] = Forward(layer, args)[0].shape();
      every.push_back(std::move(args));
    }
    if (shapes != nullptr) *shapes = output_shape;
    return every;
  }
};

// Two levels (so a decoder reads the decoder below it), two input channels, a batch of two; 8^3
// voxels and 2-8 channels keep each layer's check well under a second.
constexpr UNet3dConfig kGradientConfig{
    .in_channels = 2, .classes = 3, .base_channels = 2, .depth = 2, .groups = 2, .volume = 8};

TEST_F(UNet3dGradientTest, EveryLayerMatchesFiniteDifferences) {
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(kGradientConfig, CpuRegistry()));
  std::vector<Shape> output_shape;
  const std::vector<Tensors> args = ArgsOfEveryLayer(model, &output_shape);
  for (size_t l = 0; l < model.layers.size(); ++l) {
    SCOPED_TRACE(model.layers[l].name);
    Check(model.layers[l], args[l]);
  }
  EXPECT_EQ(output_shape[LayerIndex(model, "down1")], (Shape{kBatch, 4, 2, 2, 2}));
  EXPECT_EQ(output_shape[LayerIndex(model, "bottleneck")], (Shape{kBatch, 8, 2, 2, 2}));
  EXPECT_EQ(output_shape[LayerIndex(model, "up1")], (Shape{kBatch, 4, 4, 4, 4}));
  EXPECT_EQ(output_shape[LayerIndex(model, "head")], (Shape{kBatch, 3, 8, 8, 8}));
}

// Keeping part (attribute rebuild = cheap_ops): a layer's forward saves only what its
// convolutions make, its backward runs the norms, activations and concatenations again, and
// every output and gradient is the whole keep's bit for bit.
// The nnU-Net-shaped variant at gradient-check size: channels 2, 3, 3 (capped at 3), instance
// norm, levels reached by stride-2 convolutions (no pooling layers). Its activation here is SiLU:
// central differences of step 1e-2 across leaky ReLU's kink at 0 are not its derivative (seen:
// 4% off on dec0's parameters), and leaky ReLU's own gradient is checked on inputs away from the
// kink (volume_ops_test); the layers' wiring is what this checks.
constexpr UNet3dConfig kNnUNetGradientConfig{.in_channels = 2,
                                             .classes = 3,
                                             .base_channels = 2,
                                             .depth = 2,
                                             .volume = 8,
                                             .max_channels = 3,
                                             .norm = UNetNorm::kInstance,
                                             .activation = UNetActivation::kSilu,
                                             .downsample = UNetDownsample::kStridedConv};

TEST_F(UNet3dGradientTest, TheNnUNetVariantsLayersMatchFiniteDifferences) {
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(kNnUNetGradientConfig, CpuRegistry()));
  for (const LayerSpec& layer : model.layers) EXPECT_FALSE(layer.name.starts_with("down"));
  std::vector<Shape> output_shape;
  const std::vector<Tensors> args = ArgsOfEveryLayer(model, &output_shape);
  for (size_t l = 0; l < model.layers.size(); ++l) {
    SCOPED_TRACE(model.layers[l].name);
    Check(model.layers[l], args[l]);
  }
  EXPECT_EQ(output_shape[LayerIndex(model, "enc0")], (Shape{kBatch, 2, 8, 8, 8}));
  EXPECT_EQ(output_shape[LayerIndex(model, "enc1")], (Shape{kBatch, 3, 4, 4, 4}));  // stride 2
  EXPECT_EQ(output_shape[LayerIndex(model, "bottleneck")], (Shape{kBatch, 3, 2, 2, 2}));
  EXPECT_EQ(output_shape[LayerIndex(model, "up1")], (Shape{kBatch, 3, 4, 4, 4}));
  EXPECT_EQ(output_shape[LayerIndex(model, "head")], (Shape{kBatch, 3, 8, 8, 8}));
}

// Deep supervision (nnU-Net's): a head on each decoder level 1 to depth - 2, the loss the sum of
// each level's cross-entropy against the labels sampled down to it, weighted 2^-level and
// normalised. Three levels at 8^3: head1 on dec1 (4^3); the coarsest decoder level (dec2, 2^3)
// has none. Every layer's gradients (the loss's three inputs among them) match central
// differences, and the loss is its definition computed from the kernels directly.
constexpr UNet3dConfig kDeepSupervisionConfig{.in_channels = 1,
                                              .classes = 3,
                                              .base_channels = 2,
                                              .depth = 3,
                                              .groups = 2,
                                              .volume = 8,
                                              .deep_supervision = true};

TEST_F(UNet3dGradientTest, DeepSupervisionSumsTheWeightedLevelsAndTheirGradientsMatch) {
  const std::vector<double> weights = kDeepSupervisionConfig.DeepSupervisionWeights();
  ASSERT_EQ(weights.size(), 2u);
  EXPECT_DOUBLE_EQ(weights[0], 2.0 / 3);
  EXPECT_DOUBLE_EQ(weights[1], 1.0 / 3);
  EXPECT_EQ(UNet3dConfig{}.DeepSupervisionWeights(), std::vector<double>{1.0});
  ASSERT_OK_AND_ASSIGN(UNet3dConfig nnunet, UNet3dConfig::Preset("nnunet"));
  nnunet.deep_supervision = true;
  const std::vector<double> five = nnunet.DeepSupervisionWeights();
  ASSERT_EQ(five.size(), 4u);  // levels 0-3; level 4 (the coarsest decoder's) unsupervised
  for (size_t i = 0; i < five.size(); ++i)
    EXPECT_DOUBLE_EQ(five[i], std::ldexp(1.0, -int(i)) / 1.875);
  EXPECT_NE(nnunet.ToString().find("deep_supervision"), std::string::npos);

  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(kDeepSupervisionConfig, CpuRegistry()));
  EXPECT_LT(LayerIndex(model, "dec1"), LayerIndex(model, "head1"));
  for (const LayerSpec& layer : model.layers) EXPECT_NE(layer.name, "head2");
  std::vector<Shape> output_shape;
  const std::vector<Tensors> args = ArgsOfEveryLayer(model, &output_shape);
  EXPECT_EQ(output_shape[LayerIndex(model, "head1")], (Shape{kBatch, 3, 4, 4, 4}));
  for (size_t l = 0; l < model.layers.size(); ++l) {
    SCOPED_TRACE(model.layers[l].name);
    Check(model.layers[l], args[l]);
  }

  // The loss layer reads the full-resolution logits, the labels, then head1's logits.
  const size_t loss = LayerIndex(model, "loss");
  const Tensors& in = args[loss];
  ASSERT_GE(in.size(), 3u);
  constexpr int64_t kVoxels = int64_t{8} * 8 * 8, kCoarseVoxels = int64_t{4} * 4 * 4;
  std::vector<int32_t> coarse(static_cast<size_t>(kBatch * kCoarseVoxels));
  cpu::DownsampleLabels(coarse.data(), in[1].data<int32_t>(), kBatch, 8, 8, 8, 2);
  ASSERT_OK_AND_ASSIGN(const float fine_loss,
                       cpu::VoxelCrossEntropy(nullptr, in[0].data<float>(), in[1].data<int32_t>(),
                                              kBatch, 3, kVoxels, 1.0f));
  ASSERT_OK_AND_ASSIGN(const float coarse_loss,
                       cpu::VoxelCrossEntropy(nullptr, in[2].data<float>(), coarse.data(), kBatch,
                                              3, kCoarseVoxels, 1.0f));
  const double expected = weights[0] * fine_loss + weights[1] * coarse_loss;
  const Tensors out = Forward(model.layers[loss], in);
  EXPECT_NEAR(*out[0].data<float>(), expected, 1e-6 * expected);
  // The nearest-exact sample of each 2^3 block: voxel (1, 1, 1) of the first block.
  EXPECT_EQ(coarse[0], in[1].data<int32_t>()[(1 * 8 + 1) * 8 + 1]);
}

// The preset's parameters by hand: per level two conv blocks (weights out*in*27, bias, and an
// instance norm's gain and bias per channel), up-convolutions [from, to, 2, 2, 2] + bias, the
// decoders reading 2*to channels, the 1x1x1 head; about 31 M, as nnU-Net's 3d_fullres network for
// one input channel.
TEST(UNet3dTest, TheNnUNetPresetHasSixStagesOfUpTo320Channels) {
  ASSERT_OK_AND_ASSIGN(UNet3dConfig config, UNet3dConfig::Preset("nnunet"));
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(config, CpuRegistry()));
  auto block = [](int64_t in, int64_t out) { return out * in * 27 + out + 2 * out; };
  const std::vector<int64_t> c = {32, 64, 128, 256, 320, 320};
  int64_t expected = 0;
  int64_t in = 1;
  for (int64_t i = 0; i < 5; ++i) {
    const int64_t enc = block(in, c[i]) + block(c[i], c[i]);
    EXPECT_EQ(model.layers[LayerIndex(model, fmt::format("enc{}", i))].params.numel(), enc);
    expected += enc;
    in = c[i];
  }
  expected += block(320, 320) + block(320, 320);  // the bottleneck, at 4^3 for a 128^3 patch
  for (int64_t i = 4; i >= 0; --i) {
    const int64_t up = c[i + 1] * c[i] * 8 + c[i];
    const int64_t dec = block(2 * c[i], c[i]) + block(c[i], c[i]);
    EXPECT_EQ(model.layers[LayerIndex(model, fmt::format("up{}", i))].params.numel(), up);
    EXPECT_EQ(model.layers[LayerIndex(model, fmt::format("dec{}", i))].params.numel(), dec);
    expected += up + dec;
  }
  expected += 3 * 32 + 3;
  EXPECT_EQ(model.NumParameters(), expected);
  EXPECT_GT(model.NumParameters(), 30'000'000);
  EXPECT_LT(model.NumParameters(), 32'000'000);
  // 6 encoder stages (5 + the bottleneck), 5 up-convolutions, 5 decoders, head, loss.
  EXPECT_EQ(model.layers.size(), 6u + 5 + 5 + 2);
  // Its blocks: leaky ReLU, group norm with a group per channel (instance norm), and a stride-2
  // first convolution from enc1 on.
  for (const auto& [name, channels, stride] :
       {std::tuple{"enc0", 32, 1}, std::tuple{"enc1", 64, 2}, std::tuple{"enc4", 320, 2},
        std::tuple{"bottleneck", 320, 2}, std::tuple{"dec0", 32, 1}}) {
    SCOPED_TRACE(name);
    const LayerSpec& layer = model.layers[LayerIndex(model, name)];
    ASSERT_OK_AND_ASSIGN(const std::string text, layer.attrs.GetString(kProgramAttr));
    ASSERT_OK_AND_ASSIGN(LayerProgram program, LayerProgram::Decode(text));
    int activations = 0, norms = 0, convs = 0;
    for (const ProgramOp& op : program.ops) {
      if (op.op == "leaky_relu_forward") ++activations;
      if (op.op == "group_norm_forward") {
        ++norms;
        EXPECT_EQ(op.attrs.GetInt("groups", 0), channels);
      }
      if (op.op == "conv3d_forward") {
        EXPECT_EQ(op.attrs.GetInt("stride", 1), convs == 0 ? stride : 1);
        ++convs;
      }
    }
    EXPECT_EQ(activations, 2);
    EXPECT_EQ(norms, 2);
    EXPECT_EQ(convs, 2);
  }
}

TEST_F(UNet3dGradientTest, EveryLayerKeepingPartRebuildsTheRestBitForBit) {
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(kGradientConfig, CpuRegistry()));
  const std::vector<Tensors> args = ArgsOfEveryLayer(model);
  for (size_t l = 0; l < model.layers.size(); ++l) {
    const LayerSpec& layer = model.layers[l];
    SCOPED_TRACE(layer.name);
    auto run = [&](const std::string& rebuild) {
      Attrs attrs = layer.attrs;
      if (!rebuild.empty()) attrs.Set(kRebuildAttr, rebuild);
      Result<Tensors> out = RunKernel(layer.forward_op, args[l], attrs);
      TESSERA_CHECK(out.ok(), "{}", out.status().ToString());
      Result<Tensors> grads =
          RunKernel(layer.backward_op,
                    BackwardArgs(layer, args[l], *out, RandomOutputGradients(layer, *out)), attrs);
      TESSERA_CHECK(grads.ok(), "{}", grads.status().ToString());
      return std::pair(*out, *grads);
    };
    const auto [whole_out, whole_grads] = run("");
    const auto [lean_out, lean_grads] = run(kRebuildCheapOps);
    ASSERT_EQ(lean_out.size(), whole_out.size());
    ASSERT_EQ(lean_grads.size(), whole_grads.size());
    // The last output is what the forward saves.
    EXPECT_LE(lean_out.back().numel(), whole_out.back().numel());
    for (size_t i = 0; i + 1 < whole_out.size(); ++i) {
      ExpectBitIdentical(lean_out[i], whole_out[i], fmt::format("output {}", i));
    }
    for (size_t i = 0; i < whole_grads.size(); ++i) {
      ExpectBitIdentical(lean_grads[i], whole_grads[i], fmt::format("gradient {}", i));
    }
    // Two convolution blocks (conv -> group norm -> SiLU, twice) keep their two convolutions'
    // outputs; a decoder's concatenation is rebuilt from its inputs too.
    if (layer.name == "enc0" || layer.name == "dec0") {
      const int64_t conv_output = kBatch * kGradientConfig.base_channels * 8 * 8 * 8;
      EXPECT_EQ(lean_out.back().numel(), 2 * conv_output);
      EXPECT_GT(whole_out.back().numel(), 4 * conv_output);
    }
  }
  // An unknown option is named; the split backward's halves rebuild nothing.
  const size_t d = LayerIndex(model, "dec0");
  const LayerSpec& dec0 = model.layers[d];
  Attrs attrs = dec0.attrs;
  attrs.Set(kRebuildAttr, "everything");
  EXPECT_THAT(RunKernel(dec0.forward_op, args[d], attrs).status().message(),
              HasSubstr("rebuilds 'cheap_ops' only, not 'everything'"));
  attrs.Set(kRebuildAttr, kRebuildCheapOps);
  ASSERT_OK_AND_ASSIGN(Tensors out, RunKernel(dec0.forward_op, args[d], attrs));
  const Tensors backward_in = BackwardArgs(dec0, args[d], out, RandomOutputGradients(dec0, out));
  EXPECT_THAT(RunKernel("layer_backward_input", backward_in, attrs).status().message(),
              HasSubstr("the split layer backward (zero-bubble schedules) rebuilds "
                        "nothing"));
}

// ---- Volumes ----

TEST(VolumesTest, TheSameSeedGivesTheSameVolumesAndAnotherSeedOthers) {
  ASSERT_OK_AND_ASSIGN(VolumeBatch a, GenerateVolumes(3, 8, 2, 42));
  ASSERT_OK_AND_ASSIGN(VolumeBatch b, GenerateVolumes(3, 8, 2, 42));
  ASSERT_OK_AND_ASSIGN(VolumeBatch c, GenerateVolumes(3, 8, 2, 43));
  EXPECT_EQ(a.count, 3);
  EXPECT_EQ(a.channels, 2);
  EXPECT_EQ(a.volume, 8);
  ASSERT_EQ(a.volumes.size(), 3u * 2 * 8 * 8 * 8);
  ASSERT_EQ(a.labels.size(), 3u * 8 * 8 * 8);
  EXPECT_EQ(a.volumes, b.volumes);
  EXPECT_EQ(a.labels, b.labels);
  EXPECT_NE(a.volumes, c.volumes);
  EXPECT_NE(a.labels, c.labels);
  // Sample i depends only on (seed, i): a larger count starts with the same samples.
  ASSERT_OK_AND_ASSIGN(VolumeBatch more, GenerateVolumes(5, 8, 2, 42));
  EXPECT_TRUE(std::equal(a.volumes.begin(), a.volumes.end(), more.volumes.begin()));
  EXPECT_TRUE(std::equal(a.labels.begin(), a.labels.end(), more.labels.begin()));
  // Samples differ from each other.
  const size_t voxels = size_t{8} * 8 * 8;
  EXPECT_FALSE(std::equal(a.labels.begin(), a.labels.begin() + voxels, a.labels.begin() + voxels));
}

TEST(VolumesTest, LabelsAreInRangeAndABatchOfFourHoldsEveryClass) {
  for (const int64_t volume : {4, 8, 16}) {
    for (uint64_t seed = 0; seed < 5; ++seed) {
      ASSERT_OK_AND_ASSIGN(VolumeBatch batch, GenerateVolumes(4, volume, 1, seed));
      std::vector<int64_t> counts(kVolumeClasses, 0);
      for (int32_t label : batch.labels) {
        ASSERT_GE(label, 0);
        ASSERT_LT(label, kVolumeClasses);
        ++counts[static_cast<size_t>(label)];
      }
      for (int32_t k = 0; k < kVolumeClasses; ++k) {
        EXPECT_GT(counts[static_cast<size_t>(k)], 0)
            << "class " << k << ", volume " << volume << ", seed " << seed;
      }
      for (float value : batch.volumes) ASSERT_TRUE(std::isfinite(value));
    }
  }
}

TEST(VolumesTest, IntensitiesSeparateTheClassesOnAverage) {
  constexpr int64_t kCount = 4, kVolume = 16, kChannels = 2;
  ASSERT_OK_AND_ASSIGN(VolumeBatch batch, GenerateVolumes(kCount, kVolume, kChannels, 7));
  const int64_t voxels = kVolume * kVolume * kVolume;
  for (int64_t c = 0; c < kChannels; ++c) {
    std::vector<double> sum(kVolumeClasses, 0), sum_sq(kVolumeClasses, 0);
    std::vector<int64_t> n(kVolumeClasses, 0);
    for (int64_t s = 0; s < kCount; ++s) {
      for (int64_t i = 0; i < voxels; ++i) {
        const auto k = static_cast<size_t>(batch.labels[static_cast<size_t>(s * voxels + i)]);
        const double x = batch.volumes[static_cast<size_t>((s * kChannels + c) * voxels + i)];
        sum[k] += x;
        sum_sq[k] += x * x;
        ++n[k];
      }
    }
    for (size_t k = 0; k < kVolumeClasses; ++k) {
      ASSERT_GT(n[k], 100) << "class " << k;
      const double mean = sum[k] / static_cast<double>(n[k]);
      const double std = std::sqrt(sum_sq[k] / static_cast<double>(n[k]) - mean * mean);
      // The sample mean sits within 5 standard errors of the class mean; the noise is as stated.
      EXPECT_NEAR(mean, kVolumeClassMean[k], 5 * kVolumeNoiseStd / std::sqrt(n[k]))
          << "class " << k << ", channel " << c;
      EXPECT_NEAR(std, kVolumeNoiseStd, 0.1) << "class " << k << ", channel " << c;
    }
    // Class means are a full noise standard deviation apart or more: separable on average,
    // not voxel by voxel.
    for (size_t a = 0; a < kVolumeClasses; ++a) {
      for (size_t b = a + 1; b < kVolumeClasses; ++b) {
        EXPECT_GE(std::abs(sum[a] / n[a] - sum[b] / n[b]), kVolumeNoiseStd) << a << " vs " << b;
      }
    }
  }
}

TEST(VolumesTest, BadArgumentsAreRefusedNamingThem) {
  struct Case {
    int64_t count, volume, channels;
    std::string message;
  };
  const std::vector<Case> cases = {
      {0, 8, 1, "count must be >= 1, got 0"},
      {-3, 8, 1, "count must be >= 1, got -3"},
      {2, 3, 1, "volume must be >= 4"},
      {2, 8, 0, "in_channels must be >= 1, got 0"},
      {1 << 20, 1 << 10, 1, "generate fewer samples per call"},
      {int64_t{1} << 40, int64_t{1} << 30, int64_t{1} << 40, "generate fewer samples per call"},
  };
  for (const Case& c : cases) {
    Result<VolumeBatch> batch = GenerateVolumes(c.count, c.volume, c.channels, 1);
    ASSERT_FALSE(batch.ok()) << c.message;
    EXPECT_EQ(batch.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(batch.status().message().find(c.message), std::string::npos)
        << batch.status().ToString();
  }
}

}  // namespace
}  // namespace tessera::testing
