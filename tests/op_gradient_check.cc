#include "op_gradient_check.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "test_util.h"

namespace tessera::testing {

namespace {

using Tensors = std::vector<Tensor>;

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

// Element indices to perturb: first, last, and a deterministic random sample, `samples` in all
// (or every element).
std::vector<int64_t> SampleIndices(int64_t n, uint64_t seed, int samples) {
  std::set<int64_t> picked = {0, n - 1};
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> dist(0, n - 1);
  while (static_cast<int64_t>(picked.size()) < std::min<int64_t>(n, samples)) {
    picked.insert(dist(rng));
  }
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

// The backward op's inputs, as a GradientRule names them.
Tensors RuleInputs(const GradientRule& rule, const Tensors& in, const Tensors& out,
                   const Tensors& grads) {
  Tensors result;
  for (const GradientRule::Arg& arg : rule.inputs) {
    const Tensors& from = arg.from == GradientRule::From::kOutputGradient ? grads
                          : arg.from == GradientRule::From::kInput        ? in
                                                                          : out;
    result.push_back(from.at(static_cast<size_t>(arg.index)));
  }
  return result;
}

}  // namespace

void ExpectGradientsMatchFiniteDifferences(GradientCase c, int samples) {
  const bool from_rule = c.backward.empty();
  if (from_rule) {
    ASSERT_OK_AND_ASSIGN(const OpDef* def, CpuRegistry().Find(c.forward));
    ASSERT_TRUE(def->gradient.has_value()) << c.forward << " has no GradientRule";
    const GradientRule rule = *def->gradient;
    c.backward = rule.op;
    c.backward_attrs = c.forward_attrs;
    c.checked.clear();
    for (size_t j = 0; j < rule.gradient_of.size(); ++j) {
      c.checked.emplace_back(rule.gradient_of[j], static_cast<int>(j));
    }
    c.backward_inputs = [rule](const Tensors& in, const Tensors& out, const Tensors& grads) {
      return RuleInputs(rule, in, out, grads);
    };
  }
  ASSERT_OK_AND_ASSIGN(Tensors outputs, RunKernel(c.forward, c.inputs, c.forward_attrs));
  Tensors grads;
  for (size_t k = 0; k < outputs.size(); ++k) {
    const bool used = std::count(c.differentiable_outputs.begin(), c.differentiable_outputs.end(),
                                 static_cast<int>(k)) > 0;
    if (used) {
      grads.push_back(RandomTensor(outputs[k].shape(), 1000 + k));
    } else {
      // Unused outputs may be integer (pooling indices).
      ASSERT_OK_AND_ASSIGN(Tensor zeros, Tensor::Zeros(outputs[k].meta(), TestAllocator()));
      grads.push_back(zeros);
    }
  }
  ASSERT_OK_AND_ASSIGN(
      Tensors analytic,
      RunKernel(c.backward, c.backward_inputs(c.inputs, outputs, grads), c.backward_attrs));
  if (from_rule) {
    ASSERT_EQ(analytic.size(), c.checked.size()) << c.backward;
  }
  for (const auto& [input, grad_output] : c.checked) {
    ASSERT_LT(static_cast<size_t>(grad_output), analytic.size()) << c.backward;
    const Tensor& gradient = analytic[static_cast<size_t>(grad_output)];
    ASSERT_EQ(gradient.meta(), c.inputs[input].meta())
        << c.backward << " output " << grad_output << " is not shaped like " << c.forward
        << " input " << input;
    const float* a = gradient.data<float>();
    double max_error = 0, scale = 0;
    for (int64_t e : SampleIndices(c.inputs[input].numel(), 77 + input, samples)) {
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

void ExpectLossGradientMatchesFiniteDifferences(const std::string& op, Tensors inputs,
                                                double grad_scale) {
  const Attrs attrs{{"grad_scale", grad_scale}};
  ASSERT_OK_AND_ASSIGN(Tensors out, RunKernel(op, inputs, attrs));
  const std::vector<float> analytic = ToVector(out[1]);
  double max_error = 0, scale = 0;
  float* x = inputs[0].data<float>();
  for (int64_t e = 0; e < inputs[0].numel(); ++e) {
    const float original = x[e];
    auto loss_at = [&](float value) {
      x[e] = value;
      Result<Tensors> r = RunKernel(op, inputs, attrs);
      TESSERA_CHECK(r.ok());
      return static_cast<double>(*(*r)[0].data<float>());
    };
    const double numeric =
        grad_scale * (loss_at(original + 1e-2f) - loss_at(original - 1e-2f)) / 2e-2;
    x[e] = original;
    max_error = std::max(max_error, std::abs(numeric - analytic[static_cast<size_t>(e)]));
    scale = std::max(scale, std::abs(static_cast<double>(analytic[static_cast<size_t>(e)])));
  }
  EXPECT_GT(scale, 1e-3) << op;
  EXPECT_LE(max_error, 2e-2 * scale) << op;
}

}  // namespace tessera::testing
