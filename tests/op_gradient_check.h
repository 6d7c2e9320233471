// An op's backward checked against finite differences of its forward (op_gradient_test,
// volume_ops_test).
//
// For a forward op with outputs Y_k and random upstream gradients G_k (zeros for the outputs L
// does not depend on), the scalar L = sum_k <G_k, Y_k> has dL/dX = backward(G, ...). Central
// differences of L (summed in double from the f32 kernels) on a sample of each checked input's
// elements must agree with the backward's output to `tolerance` of the gradient's scale (its
// largest sampled element). The sample is the first and last elements and a deterministic random
// choice of the others.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/attrs.h"
#include "core/tensor.h"

namespace tessera::testing {

struct GradientCase {
  std::string forward;
  // Empty: the backward op, its inputs, the gradients checked and the attributes it gets (the
  // forward's) are those the forward's GradientRule names; `backward_attrs`, `checked` and
  // `backward_inputs` are then ignored, and every gradient the rule returns is checked.
  std::string backward;
  Attrs forward_attrs;
  Attrs backward_attrs;
  std::vector<Tensor> inputs;
  std::vector<int> differentiable_outputs = {0};  // forward outputs L depends on
  // forward input index -> backward output index with its gradient
  std::vector<std::pair<int, int>> checked;
  // Builds the backward's inputs from the forward's inputs, outputs and upstream gradients
  // (one per forward output).
  std::function<std::vector<Tensor>(const std::vector<Tensor>& in, const std::vector<Tensor>& out,
                                    const std::vector<Tensor>& grads)>
      backward_inputs;
  float step = 1e-2f;
  double tolerance = 2e-2;
};

// Runs the check of `c` on up to `samples` elements of each checked input; reports failures
// through gtest, naming the backward op and the input. Each gradient must also have its input's
// dtype and shape, and must not be zero on every sampled element (a vacuous check).
void ExpectGradientsMatchFiniteDifferences(GradientCase c, int samples);

// For a loss op that returns its gradient at once (outputs: the loss, then dlogits times attr
// grad_scale, computed over the first input): checks every element of dlogits against central
// differences of the loss output, to 2% of the gradient's scale.
void ExpectLossGradientMatchesFiniteDifferences(const std::string& op, std::vector<Tensor> inputs,
                                                double grad_scale);

}  // namespace tessera::testing
