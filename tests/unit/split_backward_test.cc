// Split backwards (zero-bubble pipelines, model/model_spec.h LayerSpec::backward_input_op and
// backward_weight_op): for every layer of the fused GPT-2, the model-API GPT-2 and the 3D U-Net,
// the input half then the weight half return exactly (bit for bit) the gradients of the whole
// backward, and the halves' wiring is what the planner gives them.
#include <cstring>

#include "model/gpt2.h"
#include "model/model_spec.h"
#include "model/unet3d.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

constexpr int64_t kRows = 2, kSeqLen = 16;

bool SameBits(const Tensor& a, const Tensor& b) {
  return a.meta().shape == b.meta().shape && a.meta().dtype == b.meta().dtype &&
         std::memcmp(a.raw_data(), b.raw_data(), static_cast<size_t>(a.bytes())) == 0;
}

// A model input's tensor: ids below `ids` (tokens, targets, labels), or uniform floats.
Tensor InputTensor(const ModelInput& input, int32_t ids, uint64_t seed) {
  const TensorMeta meta = input.Meta(kRows, kSeqLen);
  if (meta.dtype == DType::kI32) return RandomTokens(meta.shape, ids, seed);
  return RandomTensor(meta.shape, seed);
}

// Runs the model's forward layer by layer on random inputs and parameters; then, for each layer
// with a split backward, the whole backward and its two halves on the same random output
// gradients. Counts the layers split in `split`.
void ExpectHalvesMatchWholeBackward(const ModelSpec& model, int32_t ids, int& split) {
  std::vector<Tensor> groups, inputs;
  std::vector<std::vector<Tensor>> args(model.layers.size()), outputs(model.layers.size());
  for (size_t i = 0; i < model.inputs.size(); ++i) {
    inputs.push_back(InputTensor(model.inputs[i], ids, 10 + i));
  }
  for (size_t l = 0; l < model.layers.size(); ++l) {
    groups.push_back(RandomTensor(Shape{model.layers[l].params.numel()}, 100 + l, 0.1f));
  }
  split = 0;
  for (size_t l = 0; l < model.layers.size(); ++l) {
    const LayerSpec& layer = model.layers[l];
    SCOPED_TRACE(model.name + "/" + layer.name);
    for (const LayerArg& arg : layer.forward_args) {
      switch (arg.kind) {
        case LayerArg::Kind::kModelInput:
          args[l].push_back(inputs[arg.index]);
          break;
        case LayerArg::Kind::kActivation:
          args[l].push_back(outputs[arg.index][static_cast<size_t>(arg.output)]);
          break;
        case LayerArg::Kind::kParams:
          args[l].push_back(groups[arg.index]);
          break;
      }
    }
    Result<std::vector<Tensor>> forward = RunKernel(layer.forward_op, args[l], layer.attrs);
    ASSERT_TRUE(forward.ok()) << forward.status().ToString();
    outputs[l] = *forward;
    if (layer.backward_input_op.empty()) continue;

    std::vector<Tensor> whole, input_half, weight_half;
    for (size_t a = 0; a < layer.backward_args.size(); ++a) {
      const BackwardArg& arg = layer.backward_args[a];
      Tensor read;
      switch (arg.kind) {
        case BackwardArg::Kind::kOutputGradient:
          read = RandomTensor(outputs[l][arg.index].meta().shape, 1000 + l * 10 + a);
          break;
        case BackwardArg::Kind::kForwardArg:
          read = args[l][arg.index];
          break;
        case BackwardArg::Kind::kForwardOutput:
          read = outputs[l][arg.index];
          break;
        case BackwardArg::Kind::kGradientSoFar:
          read = RandomTensor(args[l][arg.index].meta().shape, 2000 + l);
          break;
      }
      whole.push_back(read);
      if (arg.kind != BackwardArg::Kind::kGradientSoFar) input_half.push_back(read);
      if (arg.kind != BackwardArg::Kind::kOutputGradient) weight_half.push_back(read);
    }
    ASSERT_OK_AND_ASSIGN(std::vector<Tensor> expected,
                         RunKernel(layer.backward_op, whole, layer.attrs));
    ASSERT_OK_AND_ASSIGN(std::vector<Tensor> input_grads,
                         RunKernel(layer.backward_input_op, input_half, layer.attrs));
    ASSERT_FALSE(input_grads.empty());
    weight_half.insert(weight_half.begin(), input_grads.back());  // the stash
    ASSERT_OK_AND_ASSIGN(std::vector<Tensor> weight_grads,
                         RunKernel(layer.backward_weight_op, weight_half, layer.attrs));
    ASSERT_EQ(expected.size(), layer.backward_outputs.size());
    ASSERT_EQ(input_grads.size() - 1 + weight_grads.size(), expected.size());
    size_t next_input = 0, next_weight = 0;
    for (size_t j = 0; j < expected.size(); ++j) {
      const bool input =
          layer.forward_args[layer.backward_outputs[j]].kind == LayerArg::Kind::kActivation;
      const Tensor& got = input ? input_grads[next_input++] : weight_grads[next_weight++];
      EXPECT_TRUE(SameBits(got, expected[j]))
          << "output " << j << (input ? " (input gradient)" : " (parameter gradient)")
          << ": max difference " << ScaledMaxError(ToVector(got), ToVector(expected[j]), 1e-30);
    }
    ++split;
  }
}

TEST(SplitBackwardTest, FusedGpt2BlocksHalvesGiveTheWholeBackwardBitForBit) {
  const Gpt2Config config{2, 32, 4, 64, kSeqLen};
  // The blocks split; the embedding and the head (tied through wte) keep one backward.
  int split = 0;
  ExpectHalvesMatchWholeBackward(*BuildGpt2(config), 64, split);
  EXPECT_EQ(split, 2);
}

TEST(SplitBackwardTest, ModelApiGpt2LayersHalvesGiveTheWholeBackwardBitForBit) {
  const Gpt2Config config{2, 32, 4, 64, kSeqLen};
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildGpt2(config, Gpt2LayerImpl::kPrimitive));
  // Every layer program has both halves (the planner decides which are worth splitting).
  int split = 0;
  ExpectHalvesMatchWholeBackward(model, 64, split);
  EXPECT_EQ(split, static_cast<int>(model.layers.size()));
}

TEST(SplitBackwardTest, UNetLayersHalvesGiveTheWholeBackwardBitForBit) {
  const UNet3dConfig config{.base_channels = 4, .depth = 2, .volume = 8};
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(config, CpuRegistry()));
  int split = 0;
  ExpectHalvesMatchWholeBackward(model, static_cast<int32_t>(config.classes), split);
  EXPECT_EQ(split, static_cast<int>(model.layers.size()));
}

// A model-API block's input half computes dx through its four linears and leaves their output
// gradients (3C + C + 4C + C per row) and its layernorms' parameter gradients (4C) for the weight
// half; a stash of the wrong size is refused.
TEST(SplitBackwardTest, TheBlockStashesItsLinearsOutputGradientsAndAWrongStashIsRefused) {
  constexpr int64_t kChannels = 32;
  const Gpt2Config config{1, kChannels, 4, 64, kSeqLen};
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildGpt2(config, Gpt2LayerImpl::kPrimitive));
  const LayerSpec& block = model.layers[1];
  const Tensor x = RandomTensor(Shape{kRows, kSeqLen, kChannels}, 1);
  const Tensor params = RandomTensor(Shape{block.params.numel()}, 2, 0.1f);
  ASSERT_OK_AND_ASSIGN(auto forward, RunKernel("layer_forward", {x, params}, block.attrs));
  const Tensor dy = RandomTensor(x.meta().shape, 3);
  ASSERT_OK_AND_ASSIGN(auto input_half, RunKernel("layer_backward_input",
                                                  {dy, x, forward.back(), params}, block.attrs));
  ASSERT_EQ(input_half.size(), 2u);  // dx, stash
  EXPECT_EQ(input_half[0].meta().shape, x.meta().shape);
  EXPECT_GE(input_half[1].numel(), kRows * kSeqLen * 9 * kChannels + 4 * kChannels);
  const Result<std::vector<Tensor>> wrong = RunKernel(
      "layer_backward_weight", {RandomTensor(Shape{3}, 3), x, forward.back(), params}, block.attrs);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("the stash is f32[3] but the layer's input half makes"),
            std::string::npos)
      << wrong.status().ToString();
}

}  // namespace
}  // namespace tessera::testing
