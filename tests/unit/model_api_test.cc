// The model API and layer programs: programs survive their encoding; a layer's derived backward
// agrees with finite differences of its forward (parameters and inputs, a skip connection and a
// loss included); models with wrong shapes, cycles or unknown ops are refused naming the layer.
#include <cmath>
#include <random>

#include "layer_gradient_check.h"
#include "model/model.h"
#include "ops/standard_ops.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using Tensors = std::vector<Tensor>;

TEST(LayerProgramTest, EncodingRoundTripsEveryField) {
  LayerProgram program;
  program.inputs = 2;
  program.gradient_inputs = {0};
  program.loss = true;
  program.params.Add("w", Shape{3, 4}, true);
  program.params.Add("b", Shape{3}, false);
  program.ops.push_back(ProgramOp{.op = "linear_forward",
                                  .inputs = {0, 2, 3},
                                  .outputs = 1,
                                  .attrs = Attrs{{"i", int64_t{-7}},
                                                 {"f", 0.1},
                                                 {"s", std::string("a b:c")},
                                                 {"v", std::vector<int64_t>{1, 2, 3}}},
                                  .label = "fc 1"});
  program.outputs = {4};
  ASSERT_OK_AND_ASSIGN(LayerProgram decoded, LayerProgram::Decode(program.Encode()));
  EXPECT_EQ(decoded.Encode(), program.Encode());
  EXPECT_EQ(decoded.inputs, 2);
  EXPECT_EQ(decoded.gradient_inputs, std::vector<int>{0});
  EXPECT_TRUE(decoded.loss);
  EXPECT_EQ(decoded.params.numel(), 15);
  EXPECT_EQ(decoded.params.DecayRanges(), program.params.DecayRanges());
  ASSERT_EQ(decoded.ops.size(), 1u);
  EXPECT_EQ(decoded.ops[0].attrs, program.ops[0].attrs);
  EXPECT_EQ(decoded.ops[0].label, "fc 1");
  EXPECT_EQ(decoded.outputs, std::vector<int>{4});
}

TEST(LayerProgramTest, MalformedTextIsRefused) {
  for (const std::string text :
       {"", "LP2 0 0", "LP1 1 0 G 0 P 0 O 1 5:noop 0: 1 7 1 0 R 1 1",  // reads value 7
        "LP1 0 0 G 0 P 0 O 0 R 0", "LP1 0 0 G 0 P 0 O 0 R 1 0 extra"}) {
    EXPECT_FALSE(LayerProgram::Decode(text).ok()) << text;
  }
}

// A residual MLP block: y = x + fc2(gelu(fc1(layernorm(x)))), parameters in one group.
Result<ModelSpec> ResidualMlp(int64_t channels, int64_t hidden) {
  ModelBuilder model("residual_mlp", CpuRegistry());
  ModelValue x = model.Input("x", DType::kF32, Shape{2, 3, channels});
  ModelValue y = model.Input("y", DType::kI32, Shape{6}, /*label=*/true);
  ModelValue h = model.Layer("block", {x}, [&](LayerBuilder& l) {
    LayerValue ln_w = l.Param("ln_w", Shape{channels}, ParamInit::Ones());
    LayerValue ln_b = l.Param("ln_b", Shape{channels}, ParamInit::Zeros());
    LayerValue w1 = l.Param("w1", Shape{hidden, channels}, ParamInit::Normal(0.2), true);
    LayerValue b1 = l.Param("b1", Shape{hidden}, ParamInit::Zeros());
    LayerValue w2 = l.Param("w2", Shape{channels, hidden}, ParamInit::Normal(0.2), true);
    LayerValue b2 = l.Param("b2", Shape{channels}, ParamInit::Zeros());
    LayerValue normed = l.Call("layernorm_forward", {l.input(0), ln_w, ln_b}, {}, "ln");
    LayerValue up = l.Call("gelu_forward", {l.Call("linear_forward", {normed, w1, b1}, {}, "fc1")});
    return l.Call("add_forward", {l.input(0), l.Call("linear_forward", {up, w2, b2}, {}, "fc2")});
  });
  ModelValue logits = model.Layer("project", {h, x}, [&](LayerBuilder& l) {
    LayerValue w = l.Param("w", Shape{channels, channels}, ParamInit::Normal(0.2), true);
    LayerValue b = l.Param("b", Shape{channels}, ParamInit::Zeros());
    // A skip connection: the model input x is read again two layers later.
    return l.Call("add_forward", {l.Call("linear_forward", {l.input(0), w, b}), l.input(1)});
  });
  model.Loss("loss", {logits, y}, [&](LayerBuilder& l) {
    return l.Call(
        "softmax_cross_entropy",
        {l.Call("reshape", {l.input(0)}, Attrs{{"shape", std::vector<int64_t>{-1, channels}}}),
         l.input(1)});
  });
  return model.Build();
}

// Every gradient rule names a registered backward op, reads what exists and returns gradients
// of inputs that exist; its backward's inference accepts what the rule passes.
TEST(GradientRuleTest, EveryRuleIsWiredToARegisteredBackward) {
  const OpRegistry& registry = CpuRegistry();
  int rules = 0;
  for (const std::string& name : registry.OpNames()) {
    ASSERT_OK_AND_ASSIGN(const OpDef* def, registry.Find(name));
    if (!def->gradient) continue;
    ++rules;
    const GradientRule& rule = *def->gradient;
    ASSERT_OK_AND_ASSIGN(const OpDef* backward, registry.Find(rule.op));
    EXPECT_EQ(rule.inputs.size(), backward->input_names.size()) << name;
    EXPECT_EQ(rule.gradient_of.size(), backward->output_names.size()) << name;
    for (const GradientRule::Arg& arg : rule.inputs) {
      const size_t limit = arg.from == GradientRule::From::kInput ? def->input_names.size()
                                                                  : def->output_names.size();
      EXPECT_LT(static_cast<size_t>(arg.index), limit) << name;
    }
    for (int input : rule.gradient_of) {
      EXPECT_LT(static_cast<size_t>(input), def->input_names.size()) << name;
    }
  }
  EXPECT_GE(rules, 9);
}

TEST(ModelBuilderTest, BuildsLayersWithDerivedBackwards) {
  ASSERT_OK_AND_ASSIGN(ModelSpec model, ResidualMlp(8, 16));
  ASSERT_EQ(model.layers.size(), 3u);
  EXPECT_EQ(model.layers[0].name, "block");
  EXPECT_EQ(model.layers[0].params.numel(), 8 + 8 + 16 * 8 + 16 + 8 * 16 + 8);
  EXPECT_EQ(model.layers[0].forward_op, "layer_forward");
  EXPECT_EQ(model.layers[0].backward_op, "layer_backward");
  EXPECT_TRUE(model.layers[2].loss);
  // "project" reads the block's output and the model input x: a gradient for the first only.
  EXPECT_EQ(model.layers[1].backward_outputs, (std::vector<size_t>{0, 2}));
  EXPECT_OK(model.Validate());
}

TEST(ModelBuilderTest, AWrongShapeIsRefusedNamingTheLayerOpAndShapes) {
  ModelBuilder model("bad", CpuRegistry());
  ModelValue x = model.Input("x", DType::kF32, Shape{4, 10});
  ModelValue y = model.Input("y", DType::kI32, Shape{4}, true);
  ModelValue h = model.Layer("fc1", {x}, [](LayerBuilder& l) {
    LayerValue w = l.Param("w", Shape{5, 12}, ParamInit::Normal(0.1));  // 12 != 10 inputs
    LayerValue b = l.Param("b", Shape{5}, ParamInit::Zeros());
    return l.Call("linear_forward", {l.input(0), w, b}, {}, "fc1_linear");
  });
  model.Loss("loss", {h, y}, [](LayerBuilder& l) {
    return l.Call("softmax_cross_entropy", {l.input(0), l.input(1)});
  });
  Result<ModelSpec> built = model.Build();
  ASSERT_FALSE(built.ok());
  const std::string message = built.status().ToString();
  EXPECT_NE(message.find("layer 'fc1'"), std::string::npos) << message;
  EXPECT_NE(message.find("fc1_linear"), std::string::npos) << message;
  EXPECT_NE(message.find("[5, 12]"), std::string::npos) << message;
  EXPECT_NE(message.find("[4, 10]"), std::string::npos) << message;
}

TEST(ModelBuilderTest, ACycleIsRefusedNamingItsLayers) {
  ModelBuilder model("cyclic", CpuRegistry());
  ModelValue x = model.Input("x", DType::kF32, Shape{4, 6});
  ModelValue y = model.Input("y", DType::kI32, Shape{4}, true);
  auto relu_like = [](LayerBuilder& l) { return l.Call("gelu_forward", {l.input(0)}); };
  auto sum = [](LayerBuilder& l) { return l.Call("add_forward", {l.input(0), l.input(1)}); };
  model.Layer("a", {x, ModelBuilder::LayerOutput("c")}, sum);
  model.Layer("b", {ModelBuilder::LayerOutput("a")}, relu_like);
  ModelValue c = model.Layer("c", {ModelBuilder::LayerOutput("b")}, relu_like);
  model.Loss("loss", {c, y}, [](LayerBuilder& l) {
    return l.Call("softmax_cross_entropy", {l.input(0), l.input(1)});
  });
  Result<ModelSpec> built = model.Build();
  ASSERT_FALSE(built.ok());
  const std::string message = built.status().ToString();
  EXPECT_NE(message.find("cycle"), std::string::npos) << message;
  EXPECT_NE(message.find("a, b, c"), std::string::npos) << message;
}

TEST(ModelBuilderTest, LayersDeclaredOutOfOrderAreSorted) {
  ModelBuilder model("reordered", CpuRegistry());
  ModelValue x = model.Input("x", DType::kF32, Shape{4, 6});
  ModelValue y = model.Input("y", DType::kI32, Shape{4}, true);
  model.Loss("loss", {ModelBuilder::LayerOutput("second"), y}, [](LayerBuilder& l) {
    return l.Call("softmax_cross_entropy", {l.input(0), l.input(1)});
  });
  model.Layer("second", {ModelBuilder::LayerOutput("first")},
              [](LayerBuilder& l) { return l.Call("gelu_forward", {l.input(0)}); });
  model.Layer("first", {x}, [](LayerBuilder& l) {
    LayerValue w = l.Param("w", Shape{6, 6}, ParamInit::Normal(0.1));
    LayerValue b = l.Param("b", Shape{6}, ParamInit::Zeros());
    return l.Call("linear_forward", {l.input(0), w, b});
  });
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, model.Build());
  ASSERT_EQ(spec.layers.size(), 3u);
  EXPECT_EQ(spec.layers[0].name, "first");
  EXPECT_EQ(spec.layers[1].name, "second");
  EXPECT_EQ(spec.layers[2].name, "loss");
}

TEST(ModelBuilderTest, UnknownOpsAndNoGradientRulesAreRefused) {
  {
    ModelBuilder model("unknown", CpuRegistry());
    ModelValue x = model.Input("x", DType::kF32, Shape{4, 6});
    ModelValue y = model.Input("y", DType::kI32, Shape{4}, true);
    ModelValue h =
        model.Layer("odd", {x}, [](LayerBuilder& l) { return l.Call("frobnicate", {l.input(0)}); });
    model.Loss("loss", {h, y}, [](LayerBuilder& l) {
      return l.Call("softmax_cross_entropy", {l.input(0), l.input(1)});
    });
    Result<ModelSpec> built = model.Build();
    ASSERT_FALSE(built.ok());
    EXPECT_NE(built.status().ToString().find("'odd'"), std::string::npos);
    EXPECT_NE(built.status().ToString().find("frobnicate"), std::string::npos);
  }
  {
    ModelBuilder model("no_rule", CpuRegistry());
    ModelValue x = model.Input("x", DType::kF32, Shape{4, 6});
    ModelValue y = model.Input("y", DType::kI32, Shape{4}, true);
    ModelValue h = model.Layer("squared", {x}, [](LayerBuilder& l) {
      LayerValue w = l.Param("w", Shape{6}, ParamInit::Ones());
      return l.Call("sum_of_squares", {w});  // no gradient rule, on the gradient's path
    });
    model.Loss("loss", {h, y}, [](LayerBuilder& l) {
      return l.Call("softmax_cross_entropy", {l.input(0), l.input(1)});
    });
    Result<ModelSpec> built = model.Build();
    ASSERT_FALSE(built.ok());
    EXPECT_NE(built.status().ToString().find("no gradient rule"), std::string::npos)
        << built.status().ToString();
  }
}

// Each layer's derived backward (its f32 inputs and its parameter group) against central
// differences of its forward.
class LayerGradientTest : public ::testing::Test {
 protected:
  static Tensors Forward(const LayerSpec& layer, const Tensors& args) {
    Result<Tensors> out = RunKernel(layer.forward_op, args, layer.attrs);
    TESSERA_CHECK(out.ok(), "{}", out.status().ToString());
    return *out;
  }
  static void Check(const LayerSpec& layer, Tensors args) {
    ExpectLayerGradientsMatchFiniteDifferences(layer, std::move(args));
  }
};

TEST_F(LayerGradientTest, EveryLayerOfAResidualMlpMatchesFiniteDifferences) {
  ASSERT_OK_AND_ASSIGN(ModelSpec model, ResidualMlp(8, 16));
  const Tensor x = RandomTensor(Shape{2, 3, 8}, 1);
  const Tensor block_params = RandomTensor(Shape{model.layers[0].params.numel()}, 2, 0.5f);
  Check(model.layers[0], {x, block_params});
  const Tensor h = RandomTensor(Shape{2, 3, 8}, 3);
  Check(model.layers[1], {h, x, RandomTensor(Shape{model.layers[1].params.numel()}, 4, 0.5f)});
  Check(model.layers[2], {RandomTensor(Shape{2, 3, 8}, 5), RandomTokens(Shape{6}, 8, 6)});
}

TEST_F(LayerGradientTest, APaddedParameterGroupGetsZeroGradientInItsPadding) {
  ASSERT_OK_AND_ASSIGN(ModelSpec model, ResidualMlp(8, 16));
  LayerSpec layer = model.layers[1];
  const int64_t numel = layer.params.numel();  // 8*8 + 8 = 72; padded to a multiple of 5: 75
  layer.attrs.Set(kParamMultipleAttr, int64_t{5});
  const Tensor params = RandomTensor(Shape{75}, 9);
  const Tensor h = RandomTensor(Shape{2, 3, 8}, 3), x = RandomTensor(Shape{2, 3, 8}, 1);
  const Tensors out = Forward(layer, {h, x, params});
  ASSERT_OK_AND_ASSIGN(
      Tensors grads,
      RunKernel(layer.backward_op, {RandomTensor(out[0].shape(), 10), h, x, out[1], params},
                layer.attrs));
  ASSERT_EQ(grads.back().numel(), 75);
  for (int64_t i = numel; i < 75; ++i) EXPECT_EQ(grads.back().data<float>()[i], 0.0f);
  Check(layer, {h, x, params});
}

}  // namespace
}  // namespace tessera::testing
