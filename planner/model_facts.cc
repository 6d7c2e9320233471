#include "planner/model_facts.h"

#include "ops/standard_ops.h"

namespace tessera {

Status CheckShapeOfBatch(const ModelSpec& model, int64_t batch, int64_t seq_len) {
  TESSERA_RETURN_IF_ERROR(model.Validate());
  if (batch <= 0) return InvalidArgument("batch must be positive, got {}", batch);
  for (const ModelInput& input : model.inputs) {
    if (input.shape.rank() < 1 || (input.sequence && input.shape.rank() < 2)) {
      return InvalidArgument("model input '{}' has shape {}: it needs a batch dimension{}",
                             input.name, input.shape.ToString(),
                             input.sequence ? " and a sequence dimension" : "");
    }
    if (input.sequence && (seq_len <= 0 || seq_len > input.shape[1])) {
      return InvalidArgument("seq_len {} must be in [1, {}] (the model's max_seq_len)", seq_len,
                             input.shape[1]);
    }
  }
  return Status::Ok();
}

bool SplitsLayerBackward(const ModelSpec& model, size_t l) {
  const LayerSpec& layer = model.layers[l];
  if (layer.backward_input_op.empty()) return false;
  bool input_gradient = false, param_gradient = false;
  for (size_t target : layer.backward_outputs) {
    const LayerArg& arg = layer.forward_args[target];
    if (arg.kind == LayerArg::Kind::kActivation) {
      input_gradient = true;
      continue;
    }
    param_gradient = true;
    for (size_t other = 0; other < model.layers.size(); ++other) {
      const LayerSpec& reader = model.layers[other];
      if (other == l) continue;
      for (const BackwardArg& back : reader.backward_args) {
        if (back.kind == BackwardArg::Kind::kGradientSoFar &&
            reader.forward_args[back.index].index == arg.index) {
          return false;
        }
      }
    }
  }
  return input_gradient && param_gradient;
}

Attrs LayerAttrs(const LayerSpec& layer, int64_t param_multiple) {
  Attrs attrs = layer.attrs;
  if (param_multiple > 1) attrs.Set(kParamMultipleAttr, param_multiple);
  return attrs;
}

}  // namespace tessera
