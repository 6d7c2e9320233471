// The model API and layer programs: programs survive their encoding; a layer's derived backward
// agrees with finite differences of its forward (parameters and inputs, a skip connection and a
// loss included); models with wrong shapes, cycles or unknown ops are refused naming the layer.
// A parameter shared across layers (a tied classifier) gets the sum of both layers' gradients.
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
  EXPECT_TRUE(decoded.shared.empty());
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

TEST(LayerProgramTest, SharedGroupsRoundTripAndNumberTheirValuesAfterTheParameters) {
  LayerProgram program;
  program.inputs = 1;
  program.params.Add("g", Shape{4});
  FlatLayout owner;
  owner.Add("wte", Shape{10, 4}, true);
  owner.Add("wpe", Shape{8, 4}, true);
  program.shared.push_back(SharedGroup{.layer = "embedding", .params = owner, .slots = {0}});
  program.shared.push_back(SharedGroup{.layer = "other", .params = owner, .slots = {1, 0}});
  EXPECT_EQ(program.first_shared(0), 2);
  EXPECT_EQ(program.first_shared(1), 3);
  EXPECT_EQ(program.num_leaf_values(), 5);
  program.ops.push_back(ProgramOp{.op = "linear_no_bias_forward", .inputs = {0, 2}});
  program.outputs = {5};
  EXPECT_EQ(program.first_output(0), 5);
  ASSERT_OK_AND_ASSIGN(LayerProgram decoded, LayerProgram::Decode(program.Encode()));
  EXPECT_EQ(decoded.Encode(), program.Encode());
  ASSERT_EQ(decoded.shared.size(), 2u);
  EXPECT_EQ(decoded.shared[0].layer, "embedding");
  EXPECT_EQ(decoded.shared[1].layer, "other");
  EXPECT_EQ(decoded.shared[1].slots, (std::vector<int>{1, 0}));
  EXPECT_EQ(decoded.shared[1].params.offset("wpe"), 40);
  EXPECT_EQ(decoded.shared[0].params.DecayRanges(), owner.DecayRanges());
  EXPECT_EQ(decoded.num_values(), 6);
}

TEST(LayerProgramTest, MalformedTextIsRefused) {
  for (const std::string text :
       {"", "LP2 0 0", "LP2 1 0 G 0 P 0 S 0 O 1 5:noop 0: 1 7 1 0 R 1 1",  // reads value 7
        "LP2 0 0 G 0 P 0 S 0 O 0 R 0", "LP2 0 0 G 0 P 0 S 0 O 0 R 1 0 extra",
        "LP1 0 0 G 0 P 0 O 0 R 1 0",                          // the old version
        "LP2 0 0 G 0 P 0 S 1 1:e 1 1:w 0 1 4 1 1 O 0 R 1 0",  // uses slot 1 of 1
        "LP2 0 0 G 0 P 0 S 1 1:e 1 1:w 0 1 4 1 0 O 1 5:noop 0: 1 1 1 0 R 1 1"}) {  // value 1
    EXPECT_FALSE(LayerProgram::Decode(text).ok()) << text;
  }
  // The last two, corrected, are programs.
  EXPECT_OK(LayerProgram::Decode("LP2 0 0 G 0 P 0 S 1 1:e 1 1:w 0 1 4 1 0 O 0 R 1 0").status());
  EXPECT_OK(
      LayerProgram::Decode("LP2 0 0 G 0 P 0 S 1 1:e 1 1:w 0 1 4 1 0 O 1 5:noop 0: 1 0 1 0 R 1 1")
          .status());
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

// Two layers sharing a weight, tied as GPT-2's embedding and classifier: "encode" owns
// w [hidden, features] (h = gelu(x @ w^T + b), and a matrix u it does not use), and the loss
// layer "classify" reads w through SharedParam to map h back: logits = layernorm(h) @ w.
constexpr int64_t kTiedRows = 6, kTiedFeatures = 5, kTiedHidden = 7;

Result<ModelSpec> TiedModel() {
  ModelBuilder model("tied", CpuRegistry());
  ModelValue x = model.Input("x", DType::kF32, Shape{kTiedRows, kTiedFeatures});
  ModelValue y = model.Input("y", DType::kI32, Shape{kTiedRows}, /*label=*/true);
  // Declared before its owner: Build puts the owner first.
  model.Loss("classify", {ModelBuilder::LayerOutput("encode"), y}, [](LayerBuilder& l) {
    LayerValue g = l.Param("ln_w", Shape{kTiedHidden}, ParamInit::Ones());
    LayerValue beta = l.Param("ln_b", Shape{kTiedHidden}, ParamInit::Zeros());
    LayerValue w = l.SharedParam("encode", "w");
    EXPECT_EQ(l.SharedParam("encode", "w").id, w.id);  // asked twice: the same value
    LayerValue normed = l.Call("layernorm_forward", {l.input(0), g, beta});
    return l.Call("softmax_cross_entropy", {l.Call("matmul_forward", {normed, w}), l.input(1)});
  });
  model.Layer("encode", {x}, [](LayerBuilder& l) {
    LayerValue u = l.Param("u", Shape{3, 2}, ParamInit::Normal(0.5), true);
    LayerValue w = l.Param("w", Shape{kTiedHidden, kTiedFeatures}, ParamInit::Normal(0.5), true);
    LayerValue b = l.Param("b", Shape{kTiedHidden}, ParamInit::Zeros());
    (void)u;
    return l.Call("gelu_forward", {l.Call("linear_forward", {l.input(0), w, b})});
  });
  return model.Build();
}

TEST(SharedParamTest, TheReaderGetsTheOwnersGroupAndReturnsAGradientOfIt) {
  ASSERT_OK_AND_ASSIGN(ModelSpec model, TiedModel());
  ASSERT_EQ(model.layers.size(), 2u);
  EXPECT_EQ(model.layers[0].name, "encode");
  const LayerSpec& classify = model.layers[1];
  using K = LayerArg::Kind;
  ASSERT_EQ(classify.forward_args.size(), 4u);  // h, y, its group, encode's group
  EXPECT_EQ(classify.forward_args[2].kind, K::kParams);
  EXPECT_EQ(classify.forward_args[2].index, 1u);
  EXPECT_EQ(classify.forward_args[3].kind, K::kParams);
  EXPECT_EQ(classify.forward_args[3].index, 0u);
  EXPECT_EQ(classify.backward_outputs, (std::vector<size_t>{0, 2, 3}));
  ASSERT_OK_AND_ASSIGN(LayerProgram program,
                       LayerProgram::Decode(*classify.attrs.GetString(kProgramAttr)));
  ASSERT_EQ(program.shared.size(), 1u);
  EXPECT_EQ(program.shared[0].layer, "encode");
  EXPECT_EQ(program.shared[0].slots, std::vector<int>{1});
  EXPECT_OK(model.Validate());
}

// The whole model's loss L(x, y; encode's group, classify's group) against central differences:
// encode's gradient is its own backward's part plus the classifier's, as the planner sums them.
TEST(SharedParamTest, BothGroupsGradientsMatchFiniteDifferences) {
  ASSERT_OK_AND_ASSIGN(ModelSpec model, TiedModel());
  const LayerSpec& encode = model.layers[0];
  const LayerSpec& classify = model.layers[1];
  const Tensor x = RandomTensor(Shape{kTiedRows, kTiedFeatures}, 1);
  const Tensor y = RandomTokens(Shape{kTiedRows}, kTiedFeatures, 2);
  Tensors groups = {RandomTensor(Shape{encode.params.numel()}, 3, 0.5f),
                    RandomTensor(Shape{classify.params.numel()}, 4, 0.5f)};
  // Each layer alone, its inputs and groups (the shared one included).
  ExpectLayerGradientsMatchFiniteDifferences(encode, {x, groups[0]});
  ExpectLayerGradientsMatchFiniteDifferences(
      classify, {RandomTensor(Shape{kTiedRows, kTiedHidden}, 5), y, groups[1], groups[0]});

  auto loss = [&](const Tensors& g) {
    Result<Tensors> h = RunKernel(encode.forward_op, {x, g[0]}, encode.attrs);
    TESSERA_CHECK(h.ok(), "{}", h.status().ToString());
    Result<Tensors> out = RunKernel(classify.forward_op, {(*h)[0], y, g[1], g[0]}, classify.attrs);
    TESSERA_CHECK(out.ok(), "{}", out.status().ToString());
    return static_cast<double>(*(*out)[0].data<float>());
  };
  ASSERT_OK_AND_ASSIGN(Tensors h, RunKernel(encode.forward_op, {x, groups[0]}, encode.attrs));
  ASSERT_OK_AND_ASSIGN(
      Tensors out, RunKernel(classify.forward_op, {h[0], y, groups[1], groups[0]}, classify.attrs));
  // classify's backward: h, y, saved, its group, encode's group -> dh, d(its group), d(encode's).
  ASSERT_OK_AND_ASSIGN(
      Tensors head,
      RunKernel(classify.backward_op, {h[0], y, out[1], groups[1], groups[0]}, classify.attrs));
  ASSERT_EQ(head.size(), 3u);
  ASSERT_EQ(head[2].numel(), encode.params.numel());
  // Zero outside the slot it reads (u, b).
  const FlatSlot& w = encode.params.slot("w");
  for (int64_t i = 0; i < head[2].numel(); ++i) {
    if (i < w.offset || i >= w.offset + w.shape.numel()) {
      EXPECT_EQ(head[2].data<float>()[i], 0.0f) << i;
    }
  }
  ASSERT_OK_AND_ASSIGN(Tensors body,
                       RunKernel(encode.backward_op, {head[0], x, h[1], groups[0]}, encode.attrs));
  ASSERT_EQ(body.size(), 1u);
  const Tensors analytic = {body[0], head[1]};
  std::vector<float> encode_sum(static_cast<size_t>(encode.params.numel()));
  for (size_t i = 0; i < encode_sum.size(); ++i) {
    encode_sum[i] = body[0].data<float>()[i] + head[2].data<float>()[i];
  }
  for (size_t group = 0; group < 2; ++group) {
    std::vector<float> numeric, computed;
    float* data = groups[group].data<float>();
    for (int64_t i = 0; i < groups[group].numel(); ++i) {
      const float saved = data[i];
      const float step = 1e-2f;
      data[i] = saved + step;
      const double plus = loss(groups);
      data[i] = saved - step;
      const double minus = loss(groups);
      data[i] = saved;
      numeric.push_back(static_cast<float>((plus - minus) / (2 * step)));
      computed.push_back(group == 0 ? encode_sum[static_cast<size_t>(i)]
                                    : analytic[1].data<float>()[i]);
    }
    const double error = ScaledMaxError(computed, numeric, 1e-3);
    EXPECT_LT(error, 2e-2) << "group " << group;
    std::printf("[ tied ] group %zu: scaled max error against finite differences %.2e\n", group,
                error);
  }
}

TEST(SharedParamTest, AnUnknownLayerOrParameterIsRefusedNamingThem) {
  auto build = [](std::string owner, std::string param) {
    ModelBuilder model("tied", CpuRegistry());
    ModelValue x = model.Input("x", DType::kF32, Shape{4, 3});
    ModelValue y = model.Input("y", DType::kI32, Shape{4}, true);
    ModelValue h = model.Layer("encode", {x}, [](LayerBuilder& l) {
      LayerValue w = l.Param("w", Shape{5, 3}, ParamInit::Normal(0.1));
      LayerValue b = l.Param("b", Shape{5}, ParamInit::Zeros());
      return l.Call("linear_forward", {l.input(0), w, b});
    });
    model.Loss("classify", {h, y}, [&](LayerBuilder& l) {
      LayerValue w = l.SharedParam(owner, param);
      return l.Call("softmax_cross_entropy",
                    {l.Call("matmul_forward", {l.input(0), w}), l.input(1)});
    });
    return model.Build();
  };
  ASSERT_OK(build("encode", "w").status());
  Result<ModelSpec> no_layer = build("encoder", "w");
  ASSERT_FALSE(no_layer.ok());
  EXPECT_NE(no_layer.status().ToString().find("layer 'classify' reads parameter 'w' of layer "
                                              "'encoder', which is not declared"),
            std::string::npos)
      << no_layer.status().ToString();
  Result<ModelSpec> no_param = build("encode", "v");
  ASSERT_FALSE(no_param.ok());
  EXPECT_NE(no_param.status().ToString().find("reads parameter 'v' of layer 'encode', which has "
                                              "no parameter of that name (it has: w, b)"),
            std::string::npos)
      << no_param.status().ToString();
  Result<ModelSpec> own = build("classify", "w");
  ASSERT_FALSE(own.ok());
  EXPECT_NE(own.status().ToString().find("'classify'"), std::string::npos);
}

TEST(SharedParamTest, OwnParametersComeBeforeSharedOnes) {
  ModelBuilder model("tied", CpuRegistry());
  ModelValue x = model.Input("x", DType::kF32, Shape{4, 3});
  ModelValue y = model.Input("y", DType::kI32, Shape{4}, true);
  ModelValue h = model.Layer("encode", {x}, [](LayerBuilder& l) {
    LayerValue w = l.Param("w", Shape{5, 3}, ParamInit::Normal(0.1));
    LayerValue b = l.Param("b", Shape{5}, ParamInit::Zeros());
    return l.Call("linear_forward", {l.input(0), w, b});
  });
  model.Loss("classify", {h, y}, [](LayerBuilder& l) {
    LayerValue w = l.SharedParam("encode", "w");
    LayerValue scale = l.Param("scale", Shape{5}, ParamInit::Ones());
    (void)scale;
    return l.Call("softmax_cross_entropy", {l.Call("matmul_forward", {l.input(0), w}), l.input(1)});
  });
  Result<ModelSpec> built = model.Build();
  ASSERT_FALSE(built.ok());
  EXPECT_NE(built.status().ToString().find("after a shared parameter"), std::string::npos)
      << built.status().ToString();
}

// Every gradient rule names a registered backward op, reads what exists and returns gradients
// of inputs that exist; its backward's inference accepts what the rule passes.
TEST(GradientRuleTest, EveryRuleIsWiredToARegisteredBackward) {
  const OpRegistry& registry = CpuRegistry();
  int rules = 0, splits = 0;
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
    // A split (zero-bubble pipelines): two registered ops reading the rule's inputs, returning
    // the gradients before and after split_at.
    EXPECT_EQ(rule.input_op.empty(), rule.weight_op.empty()) << name;
    if (rule.input_op.empty()) continue;
    ++splits;
    ASSERT_OK_AND_ASSIGN(const OpDef* input_half, registry.Find(rule.input_op));
    ASSERT_OK_AND_ASSIGN(const OpDef* weight_half, registry.Find(rule.weight_op));
    EXPECT_EQ(input_half->input_names.size(), rule.inputs.size()) << name;
    EXPECT_EQ(weight_half->input_names.size(), rule.inputs.size()) << name;
    EXPECT_EQ(input_half->output_names.size(), static_cast<size_t>(rule.split_at)) << name;
    EXPECT_EQ(weight_half->output_names.size(), rule.gradient_of.size() - rule.split_at) << name;
  }
  EXPECT_GE(rules, 9);
  EXPECT_GE(splits, 4);  // linear, linear_no_bias, conv3d, conv_transpose3d
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

// Megatron-LM's sequence parallelism in the model API: a scattered sum's readers see 1/T of the
// positions, a gathered value's readers T times as many; marks outside a model split with
// shard_sequence, a gathered value read without a partial gradient, and a sharded layer holding a
// slice are refused naming the layer.
TEST(ModelBuilderTest, SequenceShardsChangeWhatReadersSeeAndAreChecked) {
  struct Marks {
    bool shard_model = true, partial_gradient = true, sliced_norm = false;
  };
  const auto build = [](const Marks& marks) {
    ModelBuilder model("sharded", CpuRegistry());
    model.SplitOver(2, marks.shard_model);
    ModelValue x = model.SequenceInput("x", DType::kF32, Shape{1, 8, 4});
    ModelValue y = model.SequenceInput("y", DType::kI32, Shape{1, 8}, /*label=*/true);
    // Each rank's value stands for its part of a sum (the model is built and checked here, not
    // trained).
    model.Layer("part", {x}, [](LayerBuilder& l) {
      LayerValue w = l.Param("w", Shape{4, 4}, ParamInit::Zeros());
      LayerValue part = l.Call("linear_no_bias_forward", {l.input(0), w});
      l.ScatterSum(part);
      return part;
    });
    model.Layer("norm", {ModelBuilder::LayerOutput("part")}, [&](LayerBuilder& l) {
      LayerValue g = l.Param("g", Shape{4}, ParamInit::Ones());
      LayerValue b = l.Param("b", Shape{4}, ParamInit::Zeros());
      if (marks.sliced_norm)
        l.SlicedParam("slice", Shape{4}, SlotSplit{.dim = 0}, ParamInit::Ones());
      l.ShardSequence();
      LayerValue n = l.Call("layernorm_forward", {l.input(0), g, b});
      l.GatherSequence(n);
      return n;
    });
    model.Layer("mean", {ModelBuilder::LayerOutput("norm")}, [&](LayerBuilder& l) {
      if (marks.partial_gradient) l.PartialGradient(0);
      return l.Call("reshape", {l.input(0)}, Attrs{{"shape", std::vector<int64_t>{-1, 4}}});
    });
    model.Loss("loss", {ModelBuilder::LayerOutput("mean"), y}, [](LayerBuilder& l) {
      LayerValue targets =
          l.Call("reshape", {l.input(1)}, Attrs{{"shape", std::vector<int64_t>{-1}}});
      return l.Call("softmax_cross_entropy", {l.input(0), targets});
    });
    return model.Build();
  };
  ASSERT_OK_AND_ASSIGN(ModelSpec model, build(Marks{}));
  EXPECT_TRUE(model.shards_sequence);
  ASSERT_OK_AND_ASSIGN(const LayerSpec* norm, model.FindLayer("norm"));
  EXPECT_TRUE(norm->tensor_parallel->sequence_sharded);
  EXPECT_TRUE(norm->tensor_parallel->gathers(0));
  ASSERT_OK_AND_ASSIGN(const LayerSpec* part, model.FindLayer("part"));
  EXPECT_TRUE(part->tensor_parallel->scatters(0));
  EXPECT_TRUE(part->tensor_parallel->partial_outputs[0]);
  const auto refused = [&](const Marks& marks, const std::string& expected) {
    Result<ModelSpec> built = build(marks);
    ASSERT_FALSE(built.ok()) << expected;
    EXPECT_NE(built.status().message().find(expected), std::string::npos)
        << built.status().ToString();
  };
  refused(Marks{.shard_model = false}, "the model is not split with shard_sequence");
  refused(Marks{.partial_gradient = false}, "reads the all-gathered output 0 of 'norm'");
  refused(Marks{.sliced_norm = true}, "a layer sharding the sequence holds its parameters whole");
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
