// A layer's backward checked against finite differences of its forward, for tests of models
// (the model API's derived backwards, GPT-2's fused layers).
#pragma once

#include <vector>

#include "core/tensor.h"
#include "model/model_spec.h"

namespace tessera::testing {

// Runs `layer`'s forward op on `args` (its forward arguments, parameter groups included) and its
// backward op, and checks each gradient the backward returns on a sample of elements against
// central differences of L = <G, outputs> for random G (the loss itself for the loss layer).
// Reports failures through gtest, naming the layer and the argument.
void ExpectLayerGradientsMatchFiniteDifferences(const LayerSpec& layer, std::vector<Tensor> args);

// Random gradients of `layer`'s outputs `out` (none for the loss layer; output o's from seed
// 100 + o), as the checks above take them.
std::vector<Tensor> RandomOutputGradients(const LayerSpec& layer, const std::vector<Tensor>& out);

// The arguments of `layer`'s backward op: `output_grads`, then the forward arguments `args` and
// forward outputs `out` its backward_args name, in their order.
std::vector<Tensor> BackwardArgs(const LayerSpec& layer, const std::vector<Tensor>& args,
                                 const std::vector<Tensor>& out, std::vector<Tensor> output_grads);

}  // namespace tessera::testing
