// What the planners read off a model, shared by the training planner's passes and the
// forward-only planners: whether a batch fits the model's inputs, whether a layer's backward
// splits, and a layer's attributes in a padded graph.
//
// Internal to planner/. Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/attrs.h"
#include "core/status.h"
#include "model/model_spec.h"

namespace tessera {

// The model's wiring (ModelSpec::Validate), a positive batch, and each input's shape against the
// plan's seq_len. InvalidArgument naming the input and what to change otherwise.
Status CheckShapeOfBatch(const ModelSpec& model, int64_t batch, int64_t seq_len);

// Whether layer l's backward can run as two tasks (input half, weight half): the layer has the
// two halves, it returns an input gradient (the half worth running early) and parameter
// gradients (the half that can wait), and no other layer's backward adds to one of the parameter
// gradients it returns (kGradientSoFar: GPT-2's embedding reads the tied classifier's wte
// gradient, which the weight half would make only at the end).
bool SplitsLayerBackward(const ModelSpec& model, size_t l);

// A layer's attributes in a graph whose groups are padded to a multiple of `param_multiple`
// (attribute param_multiple when above 1).
Attrs LayerAttrs(const LayerSpec& layer, int64_t param_multiple);

}  // namespace tessera
