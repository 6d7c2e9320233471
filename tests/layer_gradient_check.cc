#include "layer_gradient_check.h"

#include <random>

#include "test_util.h"

namespace tessera::testing {

namespace {

using Tensors = std::vector<Tensor>;

Tensors Forward(const LayerSpec& layer, const Tensors& args) {
  Result<Tensors> out = RunKernel(layer.forward_op, args, layer.attrs);
  TESSERA_CHECK(out.ok(), "{}", out.status().ToString());
  return *out;
}

double Objective(const LayerSpec& layer, const Tensors& args, const Tensors& grads) {
  const Tensors out = Forward(layer, args);
  if (layer.loss) return out[0].data<float>()[0];
  double total = 0;
  for (int o = 0; o < layer.activations; ++o) {
    const float* y = out[static_cast<size_t>(o)].data<float>();
    const float* g = grads[static_cast<size_t>(o)].data<float>();
    for (int64_t i = 0; i < out[static_cast<size_t>(o)].numel(); ++i) {
      total += double{g[i]} * y[i];
    }
  }
  return total;
}

}  // namespace

Tensors RandomOutputGradients(const LayerSpec& layer, const Tensors& out) {
  Tensors grads;
  for (int o = 0; o < (layer.loss ? 0 : layer.activations); ++o) {
    grads.push_back(RandomTensor(out[static_cast<size_t>(o)].shape(), 100 + o));
  }
  return grads;
}

Tensors BackwardArgs(const LayerSpec& layer, const Tensors& args, const Tensors& out,
                     Tensors output_grads) {
  Tensors backward_in = std::move(output_grads);
  for (const BackwardArg& arg : layer.backward_args) {
    if (arg.kind == BackwardArg::Kind::kForwardArg) backward_in.push_back(args[arg.index]);
    if (arg.kind == BackwardArg::Kind::kForwardOutput) backward_in.push_back(out[arg.index]);
  }
  return backward_in;
}

void ExpectLayerGradientsMatchFiniteDifferences(const LayerSpec& layer, Tensors args) {
  const Tensors out = Forward(layer, args);
  const Tensors grads = RandomOutputGradients(layer, out);
  ASSERT_OK_AND_ASSIGN(
      Tensors analytic,
      RunKernel(layer.backward_op, BackwardArgs(layer, args, out, grads), layer.attrs));
  ASSERT_EQ(analytic.size(), layer.backward_outputs.size()) << layer.name;
  for (size_t j = 0; j < analytic.size(); ++j) {
    const size_t target = layer.backward_outputs[j];
    Tensor& x = args[target];
    ASSERT_EQ(analytic[j].shape(), x.shape()) << layer.name;
    float* data = x.data<float>();
    std::vector<float> numeric, computed;
    std::mt19937_64 rng(7 + j);
    std::uniform_int_distribution<int64_t> pick(0, x.numel() - 1);
    for (int sample = 0; sample < 24; ++sample) {
      const int64_t i = sample == 0 ? 0 : pick(rng);
      const float saved = data[i];
      const float step = 1e-2f;
      data[i] = saved + step;
      const double plus = Objective(layer, args, grads);
      data[i] = saved - step;
      const double minus = Objective(layer, args, grads);
      data[i] = saved;
      numeric.push_back(static_cast<float>((plus - minus) / (2 * step)));
      computed.push_back(analytic[j].data<float>()[i]);
    }
    EXPECT_LT(ScaledMaxError(computed, numeric, 1e-3), 2e-2)
        << layer.name << ": the gradient of forward argument " << target;
  }
}

}  // namespace tessera::testing
