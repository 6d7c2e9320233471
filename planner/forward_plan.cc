// The forward-only planners: evaluation (the loss of a batch) and prediction (logits), one
// worker, no gradients. They share the model checks and layer attributes with the training
// planner (planner/model_facts.h) but not its expansion: no ranks, micro-batches, sharding or
// placement, and prediction drops the label inputs and may replace the loss layer's op.
#include <vector>

#include <fmt/format.h>

#include "ops/flat_layout.h"
#include "ops/graph_builder.h"
#include "planner/model_facts.h"
#include "planner/plan_state.h"
#include "planner/step_graph.h"

namespace tessera {

namespace {

std::vector<ObjectId> AddParameterInputs(GraphBuilder& builder, const ModelSpec& model,
                                         int64_t param_multiple, Device device) {
  std::vector<ObjectId> params;
  params.reserve(model.layers.size());
  for (const LayerSpec& layer : model.layers) {
    // A layer without parameters has no group (invalid id).
    params.push_back(
        layer.params.numel() == 0
            ? ObjectId()
            : builder.AddInput(layer.name + ".params",
                               TensorMeta{Shape{PaddedNumel(layer.params.numel(), param_multiple)},
                                          DType::kF32, device},
                               ObjectRole::kParameter));
  }
  return params;
}

Result<ForwardGraph> PlanForward(const ModelSpec& model, int64_t batch, int64_t seq_len,
                                 const OpRegistry& registry, int64_t param_multiple, bool predict,
                                 Device device) {
  if (param_multiple < 1) return InvalidArgument("param_multiple must be >= 1");
  TESSERA_RETURN_IF_ERROR(CheckShapeOfBatch(model, batch, seq_len));
  TESSERA_ASSIGN_OR_RETURN(const size_t loss_layer, model.LossLayer());
  const LayerSpec& loss = model.layers[loss_layer];
  // Without a prediction op, the prediction is what the loss layer reads first (the logits).
  const LayerArg* predicted = nullptr;
  for (const LayerArg& arg : loss.forward_args) {
    if (arg.kind == LayerArg::Kind::kActivation && predicted == nullptr) predicted = &arg;
  }
  if (predict && loss.predict_op.empty() && predicted == nullptr) {
    return InvalidArgument("model '{}' cannot predict: its loss layer '{}' reads no layer",
                           model.name, loss.name);
  }
  GraphBuilder builder(registry);
  ForwardGraph result;
  for (const ModelInput& input : model.inputs) {
    result.inputs.push_back(
        input.label && predict
            ? ObjectId()
            : builder.AddInput(input.name, input.Meta(batch, seq_len, device), ObjectRole::kInput));
  }
  result.params = AddParameterInputs(builder, model, param_multiple, device);
  std::vector<std::vector<ObjectId>> outputs(model.layers.size());
  for (size_t l = 0; l < model.layers.size(); ++l) {
    const LayerSpec& layer = model.layers[l];
    const bool predicting = predict && l == loss_layer;
    if (predicting && layer.predict_op.empty()) {
      outputs[l] = {outputs[predicted->index][static_cast<size_t>(predicted->output)]};
      break;
    }
    std::vector<ObjectId> args;
    for (const LayerArg& arg : layer.forward_args) {
      switch (arg.kind) {
        case LayerArg::Kind::kModelInput:
          if (!predicting || !model.inputs[arg.index].label) {
            args.push_back(result.inputs[arg.index]);
          }
          break;
        case LayerArg::Kind::kActivation:
          args.push_back(outputs[arg.index][static_cast<size_t>(arg.output)]);
          break;
        case LayerArg::Kind::kParams:
          args.push_back(result.params[arg.index]);
          break;
      }
    }
    std::vector<std::string> names;
    std::vector<ObjectRole> roles;
    if (l == loss_layer) {
      names = {predicting ? "logits" : "loss"};
      if (!predicting) roles = {ObjectRole::kOutput};
    }
    TaskOptions options;
    options.layer = layer.name;
    options.priority = kForwardPriority;
    options.output_names = std::move(names);
    options.output_roles = std::move(roles);
    options.device_kind = device.kind;
    TESSERA_ASSIGN_OR_RETURN(
        outputs[l],
        builder.AddTask(layer.name + (predicting ? "/logits" : "/forward"),
                        predicting ? layer.predict_op : layer.forward_op, std::move(args),
                        LayerAttrs(layer, param_multiple), std::move(options)));
    // A sequence-parallel model planned as one rank (its layers' cost estimates: pipeline cuts,
    // the memory plan) reads each exchanged output in the shape the all-to-all would make; its
    // values are not exchanged, so such a graph serves estimates only (a trainer evaluates the
    // whole model).
    for (size_t o = 0; o < outputs[l].size(); ++o) {
      if (!layer.exchanges(o)) continue;
      const TensorMeta& meta = builder.graph().object(outputs[l][o]).meta;
      TESSERA_ASSIGN_OR_RETURN(
          std::vector<int64_t> dims,
          ExchangedDims(meta.shape.dims(), layer.exchanged_outputs[o], model.sequence_parallel));
      TaskOptions reshape;
      reshape.layer = layer.name;
      reshape.device_kind = device.kind;
      TESSERA_ASSIGN_OR_RETURN(
          auto reshaped, builder.AddTask(fmt::format("{}/exchange{}", layer.name, o), "reshape",
                                         {outputs[l][o]}, Attrs{{"shape", dims}}, reshape));
      outputs[l][o] = reshaped[0];
    }
    // Likewise a tensor-parallel model sharding the sequence (Megatron-LM's sequence
    // parallelism): a scattered output read as its first 1/T of the elements, a gathered one as
    // T copies, each in the shape the collective makes.
    const auto& tp = layer.tensor_parallel;
    for (size_t o = 0; tp && o < outputs[l].size(); ++o) {
      if (!tp->scatters(o) && !tp->gathers(o)) continue;
      const bool gather = tp->gathers(o);
      const TensorMeta& meta = builder.graph().object(outputs[l][o]).meta;
      const int64_t ranks = model.tensor_parallel;
      TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> dims,
                               SequenceSplitDims(meta.shape.dims(), ranks, gather));
      TaskOptions split_options;
      split_options.layer = layer.name;
      split_options.device_kind = device.kind;
      const std::string name = fmt::format("{}/{}{}", layer.name, gather ? "gather" : "scatter", o);
      std::vector<ObjectId> flat;
      if (gather) {
        TESSERA_ASSIGN_OR_RETURN(
            flat, builder.AddTask(name + "/copies", "pack_shards",
                                  std::vector<ObjectId>(static_cast<size_t>(ranks), outputs[l][o]),
                                  Attrs{{"ranks", int64_t{1}}}, split_options));
      } else {
        const int64_t part = meta.numel() / ranks;
        TESSERA_ASSIGN_OR_RETURN(
            flat, builder.AddTask(name + "/part", "split", {outputs[l][o]},
                                  Attrs{{"sizes", std::vector<int64_t>{part, meta.numel() - part}}},
                                  split_options));
      }
      TESSERA_ASSIGN_OR_RETURN(
          auto reshaped,
          builder.AddTask(name, "reshape", {flat[0]}, Attrs{{"shape", dims}}, split_options));
      outputs[l][o] = reshaped[0];
    }
  }
  result.result = outputs[loss_layer][0];
  builder.MarkOutput(result.result);
  TESSERA_ASSIGN_OR_RETURN(result.graph, builder.Build());
  return result;
}

}  // namespace

Result<ForwardGraph> PlanEvalLoss(const ModelSpec& model, int64_t batch, int64_t seq_len,
                                  const OpRegistry& registry, int64_t param_multiple,
                                  Device device) {
  return PlanForward(model, batch, seq_len, registry, param_multiple, /*predict=*/false, device);
}

Result<ForwardGraph> PlanLogits(const ModelSpec& model, int64_t batch, int64_t seq_len,
                                const OpRegistry& registry, int64_t param_multiple, Device device) {
  return PlanForward(model, batch, seq_len, registry, param_multiple, /*predict=*/true, device);
}

}  // namespace tessera
