// Every op's backward checked against finite differences of its forward.
//
// For a forward op with outputs Y_k and random upstream gradients G_k, the scalar
// L = sum_k <G_k, Y_k> has dL/dX = backward(G, ...). Central differences of L (computed in
// double from the fp32 kernels) on a sample of each input's elements must agree with the
// backward's output, relative to the gradient's scale.
#include <bit>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>

#include "core/checksum.h"
#include "ops/volume_ops.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using Tensors = std::vector<Tensor>;

struct GradientCase {
  std::string forward;
  std::string backward;
  Attrs forward_attrs;
  Attrs backward_attrs;
  Tensors inputs;
  std::vector<int> differentiable_outputs;  // forward outputs L depends on
  // forward input index -> backward output index with its gradient
  std::vector<std::pair<int, int>> checked;
  // Builds the backward's inputs from the forward's inputs, outputs and upstream gradients
  // (one per forward output; zeros for outputs L does not depend on).
  std::function<Tensors(const Tensors& in, const Tensors& out, const Tensors& grads)>
      backward_inputs;
  float step = 1e-2f;
  double tolerance = 2e-2;
};

// L = sum over differentiable outputs of <G, Y>, in double.
double Objective(const GradientCase& c, const Tensors& inputs, const Tensors& grads) {
  Result<Tensors> out = RunKernel(c.forward, inputs, c.forward_attrs);
  TESSERA_CHECK(out.ok(), "{}", out.status().ToString());
  double total = 0;
  for (int k : c.differentiable_outputs) {
    const float* y = (*out)[k].data<float>();
    const float* g = grads[k].data<float>();
    for (int64_t i = 0; i < (*out)[k].numel(); ++i) total += static_cast<double>(g[i]) * y[i];
  }
  return total;
}

// Element indices to perturb: first, last, and a deterministic random sample.
std::vector<int64_t> SampleIndices(int64_t n, uint64_t seed) {
  std::set<int64_t> picked = {0, n - 1};
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> dist(0, n - 1);
  while (static_cast<int64_t>(picked.size()) < std::min<int64_t>(n, 32)) picked.insert(dist(rng));
  return {picked.begin(), picked.end()};
}

// Central difference of L with respect to one element.
double NumericGradient(const GradientCase& c, Tensors& inputs, int input, int64_t element,
                       const Tensors& grads) {
  float* x = inputs[input].data<float>();
  const float original = x[element];
  x[element] = original + c.step;
  const double plus = Objective(c, inputs, grads);
  x[element] = original - c.step;
  const double minus = Objective(c, inputs, grads);
  x[element] = original;
  // The actual perturbation after rounding to float.
  const double h = (static_cast<double>(original + c.step) - (original - c.step)) / 2.0;
  return (plus - minus) / (2.0 * h);
}

void CheckGradients(GradientCase c) {
  ASSERT_OK_AND_ASSIGN(Tensors outputs, RunKernel(c.forward, c.inputs, c.forward_attrs));
  Tensors grads;
  for (size_t k = 0; k < outputs.size(); ++k) {
    const bool used = std::count(c.differentiable_outputs.begin(), c.differentiable_outputs.end(),
                                 static_cast<int>(k)) > 0;
    Tensor g = RandomTensor(outputs[k].shape(), 1000 + k);
    if (!used) std::fill(g.data<float>(), g.data<float>() + g.numel(), 0.0f);
    grads.push_back(g);
  }
  ASSERT_OK_AND_ASSIGN(
      Tensors analytic,
      RunKernel(c.backward, c.backward_inputs(c.inputs, outputs, grads), c.backward_attrs));
  for (const auto& [input, grad_output] : c.checked) {
    const float* a = analytic[grad_output].data<float>();
    double max_error = 0, scale = 0;
    for (int64_t e : SampleIndices(c.inputs[input].numel(), 77 + input)) {
      const double numeric = NumericGradient(c, c.inputs, input, e, grads);
      max_error = std::max(max_error, std::abs(numeric - a[e]));
      scale = std::max(scale, std::abs(static_cast<double>(a[e])));
    }
    EXPECT_GT(scale, 1e-6) << c.backward << ": gradient of input " << input
                           << " is zero on every sampled element; the check would be vacuous";
    EXPECT_LE(max_error, c.tolerance * scale)
        << c.backward << ": input " << input << " max |numeric - analytic| = " << max_error
        << " at gradient scale " << scale;
  }
}

Tensor ZerosLike(const Tensor& t) {
  Tensor z = RandomTensor(t.shape(), 0);
  std::fill(z.data<float>(), z.data<float>() + z.numel(), 0.0f);
  return z;
}

TEST(OpGradientTest, Embedding) {
  CheckGradients({
      .forward = "embedding_forward",
      .backward = "embedding_backward",
      .backward_attrs = {{"vocab", int64_t{11}}, {"max_seq_len", int64_t{7}}},
      .inputs = {RandomTokens({2, 5}, 11, 1), RandomTensor({11, 8}, 2), RandomTensor({7, 8}, 3)},
      .differentiable_outputs = {0},
      .checked = {{1, 0}, {2, 1}},
      .backward_inputs = [](const Tensors& in, const Tensors&, const Tensors& g) -> Tensors {
        return {g[0], in[0]};
      },
  });
}

TEST(OpGradientTest, LayerNorm) {
  CheckGradients({
      .forward = "layernorm_forward",
      .backward = "layernorm_backward",
      .inputs = {RandomTensor({6, 16}, 1, 2.0f), RandomTensor({16}, 2), RandomTensor({16}, 3)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}, {1, 1}, {2, 2}},
      .backward_inputs = [](const Tensors& in, const Tensors& out, const Tensors& g) -> Tensors {
        return {g[0], in[0], in[1], out[1], out[2]};
      },
  });
}

TEST(OpGradientTest, Linear) {
  CheckGradients({
      .forward = "linear_forward",
      .backward = "linear_backward",
      .inputs = {RandomTensor({2, 3, 8}, 1), RandomTensor({12, 8}, 2), RandomTensor({12}, 3)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}, {1, 1}, {2, 2}},
      .backward_inputs = [](const Tensors& in, const Tensors&, const Tensors& g) -> Tensors {
        return {g[0], in[0], in[1]};
      },
  });
}

TEST(OpGradientTest, LinearNoBias) {
  CheckGradients({
      .forward = "linear_no_bias_forward",
      .backward = "linear_no_bias_backward",
      .inputs = {RandomTensor({2, 3, 8}, 1), RandomTensor({12, 8}, 2)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}, {1, 1}},
      .backward_inputs = [](const Tensors& in, const Tensors&, const Tensors& g) -> Tensors {
        return {g[0], in[0], in[1]};
      },
  });
}

TEST(OpGradientTest, Matmul) {
  CheckGradients({
      .forward = "matmul_forward",
      .backward = "matmul_backward",
      .inputs = {RandomTensor({5, 7}, 1), RandomTensor({7, 6}, 2)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}, {1, 1}},
      .backward_inputs = [](const Tensors& in, const Tensors&, const Tensors& g) -> Tensors {
        return {g[0], in[0], in[1]};
      },
  });
}

TEST(OpGradientTest, CausalAttention) {
  const Attrs heads{{"heads", int64_t{2}}};
  CheckGradients({
      .forward = "attention_forward",
      .backward = "attention_backward",
      .forward_attrs = heads,
      .backward_attrs = heads,
      .inputs = {RandomTensor({2, 6, 3 * 8}, 1, 1.5f)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}},
      .backward_inputs = [](const Tensors& in, const Tensors& out, const Tensors& g) -> Tensors {
        return {g[0], in[0], out[1]};
      },
  });
}

TEST(OpGradientTest, Gelu) {
  CheckGradients({
      .forward = "gelu_forward",
      .backward = "gelu_backward",
      .inputs = {RandomTensor({40}, 1, 3.0f)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}},
      .backward_inputs = [](const Tensors& in, const Tensors&, const Tensors& g) -> Tensors {
        return {g[0], in[0]};
      },
      .step = 1e-3f,
  });
}

TEST(OpGradientTest, ResidualAdd) {
  CheckGradients({
      .forward = "add_forward",
      .backward = "add_backward",
      .inputs = {RandomTensor({10}, 1), RandomTensor({10}, 2)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}, {1, 1}},
      .backward_inputs = [](const Tensors&, const Tensors&, const Tensors& g) -> Tensors {
        return {g[0]};
      },
  });
}

Attrs Gpt2TestAttrs() {
  return Attrs{{"channels", int64_t{16}},
               {"heads", int64_t{2}},
               {"vocab", int64_t{11}},
               {"max_seq_len", int64_t{7}}};
}

TEST(OpGradientTest, Gpt2Embedding) {
  const Attrs attrs = Gpt2TestAttrs();
  CheckGradients({
      .forward = "gpt2_embedding_forward",
      .backward = "gpt2_embedding_backward",
      .forward_attrs = attrs,
      .backward_attrs = attrs,
      .inputs = {RandomTokens({2, 5}, 11, 1), RandomTensor({11 * 16 + 7 * 16}, 2)},
      .differentiable_outputs = {0},
      .checked = {{1, 0}},
      .backward_inputs = [](const Tensors& in, const Tensors&, const Tensors& g) -> Tensors {
        return {g[0], in[0], ZerosLike(in[1])};
      },
  });
}

TEST(OpGradientTest, Gpt2Block) {
  const Attrs attrs = Gpt2TestAttrs();
  const int64_t c = 16, params = 12 * c * c + 13 * c;
  CheckGradients({
      .forward = "gpt2_block_forward",
      .backward = "gpt2_block_backward",
      .forward_attrs = attrs,
      .backward_attrs = attrs,
      .inputs = {RandomTensor({2, 5, c}, 1), RandomTensor({params}, 2, 0.5f)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}, {1, 1}},
      .backward_inputs = [](const Tensors& in, const Tensors& out, const Tensors& g) -> Tensors {
        return {g[0], in[0], out[1], in[1]};
      },
  });
}

// The head's forward produces the loss (a scalar) and keeps dlogits; its backward returns the
// gradients of that loss. L = loss.
TEST(OpGradientTest, Gpt2Head) {
  const Attrs attrs = Gpt2TestAttrs();
  CheckGradients({
      .forward = "gpt2_head_forward",
      .backward = "gpt2_head_backward",
      .forward_attrs = attrs,
      .backward_attrs = attrs,
      .inputs = {RandomTensor({2, 5, 16}, 1), RandomTensor({2 * 16}, 2, 1.0f),
                 RandomTensor({11 * 16 + 7 * 16}, 3), RandomTokens({2, 5}, 11, 4)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}, {1, 1}, {2, 2}},
      .backward_inputs = [](const Tensors& in, const Tensors& out, const Tensors& g) -> Tensors {
        // Upstream gradient of the loss must be 1 for the fused classifier; scale L instead.
        *g[0].data<float>() = 1.0f;
        return {in[0], out[1], in[1], in[2]};
      },
  });
}

// The fused classifier returns the loss and its gradient at once: check the gradient output
// against finite differences of the loss output.
TEST(OpGradientTest, SoftmaxCrossEntropy) {
  Tensors inputs = {RandomTensor({4, 9}, 1, 3.0f), RandomTokens({4}, 9, 2)};
  const Attrs attrs{{"grad_scale", 0.5}};
  ASSERT_OK_AND_ASSIGN(Tensors out, RunKernel("softmax_cross_entropy", inputs, attrs));
  const std::vector<float> analytic = ToVector(out[1]);
  double max_error = 0, scale = 0;
  float* x = inputs[0].data<float>();
  for (int64_t e = 0; e < inputs[0].numel(); ++e) {
    const float original = x[e];
    auto loss_at = [&](float value) {
      x[e] = value;
      Result<Tensors> r = RunKernel("softmax_cross_entropy", inputs, attrs);
      TESSERA_CHECK(r.ok());
      return static_cast<double>(*(*r)[0].data<float>());
    };
    const double numeric = 0.5 * (loss_at(original + 1e-2f) - loss_at(original - 1e-2f)) / 2e-2;
    x[e] = original;
    max_error = std::max(max_error, std::abs(numeric - analytic[static_cast<size_t>(e)]));
    scale = std::max(scale, std::abs(static_cast<double>(analytic[static_cast<size_t>(e)])));
  }
  EXPECT_GT(scale, 1e-3);
  EXPECT_LE(max_error, 2e-2 * scale);
}

TEST(OpGradientTest, SoftmaxCrossEntropyMatchesDirectFormula) {
  // logits [1, 3] = {1, 2, 3}, target 2: loss = log(e^1 + e^2 + e^3) - 3.
  ASSERT_OK_AND_ASSIGN(
      Tensors out,
      RunKernel("softmax_cross_entropy", {FloatTensor({1, 3}, {1, 2, 3}), IntTensor({1}, {2})}));
  const double expected = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)) - 3.0;
  EXPECT_NEAR(*out[0].data<float>(), expected, 1e-6);
}

// Ops whose correctness is checked by other tests (not differentiable, or compared with a
// naive reference instead): optimizer_test.cc.
// Collective members: against the reference in executor_test (one member) and
// collective_tasks_test (members on worker processes).
const std::set<std::string> kCheckedElsewhere = {  // model_api_test: layers run through these
                                                   // ops match finite differences
    "layer_forward",
    "layer_backward",
    "loss_gradient",
    "reshape",
    "reshape_backward",
    "adamw",
    "sgd",
    "sum_of_squares",
    "clip_scale",
    "gpt2_head_logits",
    "noop",
    "sleep",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "all_gather_in_place",
    "sum_scalars",
    "accumulate",
    "copy",
    "constant",
    "write_file"};

TEST(OpGradientTest, SleepReturnsItsInput) {
  Tensor x = RandomTensor({5}, 1);
  ASSERT_OK_AND_ASSIGN(Tensors out, RunKernel("sleep", {x}, Attrs{{"ms", int64_t{1}}}));
  EXPECT_EQ(ToVector(out[0]), ToVector(x));
  EXPECT_FALSE(RunKernel("sleep", {x}, Attrs{{"ms", int64_t{-1}}}).ok());
}

TEST(OpGradientTest, CopyReproducesItsInputBitForBit) {
  Tensor x = RandomTensor({3, 7}, 5);
  ASSERT_OK_AND_ASSIGN(Tensors out, RunKernel("copy", {x}));
  EXPECT_EQ(out[0].shape(), x.shape());
  EXPECT_EQ(ToVector(out[0]), ToVector(x));
  EXPECT_NE(out[0].raw_data(), x.raw_data());
}

TEST(OpGradientTest, WriteFileWritesTheBytesAtomicallyAndReturnsAReceipt) {
  const std::filesystem::path dir = std::filesystem::path(TempPath("write_file_op"));
  std::filesystem::remove_all(dir);
  const std::string path = (dir / "rank1" / "h.0.params.bin").string();  // parents created
  Tensor x = RandomTensor({5, 3}, 9);
  ASSERT_OK_AND_ASSIGN(Tensors out, RunKernel("write_file", {x}, Attrs{{"path", path}}));
  ASSERT_EQ(out[0].dtype(), DType::kI64);
  EXPECT_EQ(out[0].data<int64_t>()[0], x.bytes());
  EXPECT_EQ(std::bit_cast<uint64_t>(out[0].data<int64_t>()[1]), Fnv1a(x.raw_data(), x.bytes()));
  std::ifstream in(path, std::ios::binary);
  std::vector<float> back(15);
  in.read(reinterpret_cast<char*>(back.data()), 15 * sizeof(float));
  EXPECT_EQ(in.gcount(), 15 * static_cast<std::streamsize>(sizeof(float)));
  EXPECT_EQ(back, ToVector(x));
  // No temporary file is left beside it.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir / "rank1"),
                          std::filesystem::directory_iterator()),
            1);
  // A path under a regular file cannot be created: an error naming it, not a crash.
  Result<Tensors> bad = RunKernel("write_file", {x}, Attrs{{"path", path + "/under/a/file"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(path), std::string::npos) << bad.status().message();
  std::filesystem::remove_all(dir);
}

TEST(OpGradientTest, ConstantIsItsValueAndNeedsOne) {
  ASSERT_OK_AND_ASSIGN(Tensors out, RunKernel("constant", {}, Attrs{{"value", 1.0}}));
  EXPECT_EQ(out[0].shape(), Shape{});
  EXPECT_EQ(*out[0].data<float>(), 1.0f);
  EXPECT_FALSE(RunKernel("constant", {}).ok()) << "a constant without its value";
}

TEST(OpGradientTest, NoopTakesNothingAndReturnsZero) {
  ASSERT_OK_AND_ASSIGN(Tensors out, RunKernel("noop", {}));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].shape(), Shape{});
  EXPECT_EQ(*out[0].data<float>(), 0.0f);
  ASSERT_OK_AND_ASSIGN(Tensors barrier, RunKernel("noop", {RandomTensor({3}, 1), out[0]}));
  EXPECT_EQ(*barrier[0].data<float>(), 0.0f);
  EXPECT_FALSE(RunKernel("clip_scale", {}).ok()) << "clip_scale needs an input";
}

TEST(OpGradientTest, EveryRegisteredOpIsChecked) {
  const std::set<std::string> checked_here = {
      "embedding_forward",      "embedding_backward",      "layernorm_forward",
      "layernorm_backward",     "linear_forward",          "linear_backward",
      "linear_no_bias_forward", "linear_no_bias_backward", "matmul_forward",
      "matmul_backward",        "attention_forward",       "attention_backward",
      "gelu_forward",           "gelu_backward",           "add_forward",
      "add_backward",           "gpt2_embedding_forward",  "gpt2_embedding_backward",
      "gpt2_block_forward",     "gpt2_block_backward",     "gpt2_head_forward",
      "gpt2_head_backward",     "softmax_cross_entropy"};
  // The volume ops are checked in volume_ops_test.cc (which checks that each has a test).
  OpRegistry volume_ops;
  ASSERT_OK(RegisterVolumeOps(volume_ops));
  for (const std::string& op : CpuRegistry().OpNames()) {
    EXPECT_TRUE(checked_here.contains(op) || kCheckedElsewhere.contains(op) ||
                volume_ops.Find(op).ok())
        << "op '" << op << "' has no correctness test";
  }
}

}  // namespace
}  // namespace tessera::testing
