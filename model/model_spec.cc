#include "model/model_spec.h"

#include <functional>

#include <fmt/format.h>

namespace tessera {

TensorMeta ModelInput::Meta(int64_t rows, int64_t seq_len, Device device) const {
  std::vector<int64_t> dims = shape.dims();
  dims[0] = rows;
  if (sequence) dims[1] = seq_len;
  return TensorMeta{Shape(std::move(dims)), dtype, device};
}

int64_t ModelSpec::NumParameters() const {
  int64_t total = 0;
  for (const LayerSpec& layer : layers) total += layer.params.numel();
  return total;
}

Result<const LayerSpec*> ModelSpec::FindLayer(std::string_view layer_name) const {
  for (const LayerSpec& layer : layers) {
    if (layer.name == layer_name) return &layer;
  }
  return NotFound("model has no layer named '{}'", layer_name);
}

bool ModelSpec::ReadsGathered(const LayerSpec& layer, size_t arg) const {
  if (arg >= layer.forward_args.size()) return false;
  const LayerArg& read = layer.forward_args[arg];
  if (read.kind != LayerArg::Kind::kActivation || read.index >= layers.size()) return false;
  const std::optional<TensorParallelLayer>& producer = layers[read.index].tensor_parallel;
  return producer.has_value() && producer->gathers(static_cast<size_t>(read.output));
}

Result<size_t> ModelSpec::LossLayer() const {
  if (layers.empty() || !layers.back().loss) {
    return InvalidArgument("model '{}' has no loss layer: its last layer must compute the loss",
                           name);
  }
  return layers.size() - 1;
}

namespace {

// How a whole model is rewritten for `ranks` ranks of one kind, and what to say when it cannot.
struct Rewrite {
  const char* kind;  // "tensor", "sequence"
  int ModelSpec::*degree;
  const std::function<Result<ModelSpec>(int)>& split;
  const char* cannot;  // what the model lacks and the flag that runs without it
};

Result<ModelSpec> Rewritten(const ModelSpec& model, int ranks, const Rewrite& rewrite) {
  if (ranks == model.*rewrite.degree) return model;
  if (ranks < 1) {
    return InvalidArgument("{}-parallel degree must be >= 1, got {}", rewrite.kind, ranks);
  }
  if (model.rewritten()) {
    return InvalidArgument(
        "model '{}' is already split over {} tensor / {} sequence ranks; split the whole model",
        model.name, model.tensor_parallel, model.sequence_parallel);
  }
  if (!rewrite.split) return InvalidArgument("model '{}' {}", model.name, rewrite.cannot);
  TESSERA_ASSIGN_OR_RETURN(ModelSpec split, rewrite.split(ranks));
  if (split.*rewrite.degree != ranks) {
    return Internal("model '{}' split for {} {} ranks says it is split over {}", model.name, ranks,
                    rewrite.kind, split.*rewrite.degree);
  }
  TESSERA_RETURN_IF_ERROR(split.Validate());
  return split;
}

}  // namespace

Result<ModelSpec> ModelSpec::SplitForTensorParallel(int ranks, bool shard_sequence) const {
  if (tensor_parallel > 1 && ranks == tensor_parallel && shards_sequence != shard_sequence) {
    return InvalidArgument(
        "model '{}' is split over {} tensor ranks {} the sequence; split the whole model", name,
        ranks, shards_sequence ? "sharding" : "not sharding");
  }
  if (!shard_sequence) {
    return Rewritten(*this, ranks,
                     Rewrite{"tensor", &ModelSpec::tensor_parallel, split_for_tensor_parallel,
                             "does not say how its layers split over ranks (model/model.h: "
                             "ModelBuilder::SplitOver, LayerBuilder::SlicedParam), so it cannot "
                             "run tensor parallel: use --tensor-parallel 1"});
  }
  if (ranks < 2) {
    return InvalidArgument(
        "Megatron sequence parallelism shards the sequence over the tensor ranks, but there are "
        "{}: use --tensor-parallel 2 or more with it",
        ranks);
  }
  TESSERA_ASSIGN_OR_RETURN(
      ModelSpec split,
      Rewritten(*this, ranks,
                Rewrite{"tensor", &ModelSpec::tensor_parallel, split_sharding_sequence,
                        "does not say how its layers shard the sequence over tensor ranks "
                        "(model/model.h: ModelBuilder::ShardSequence), so it cannot run "
                        "Megatron sequence parallelism: use --sequence-parallel none or ulysses"}));
  if (!split.shards_sequence) {
    return Internal("model '{}' split for Megatron sequence parallelism does not shard it", name);
  }
  return split;
}

std::optional<ModelSpec::Rotated> ModelSpec::RotationOrigin(size_t l, size_t arg) const {
  if (l >= layers.size() || arg >= layers[l].forward_args.size()) return std::nullopt;
  const auto rotates = [&](const LayerArg& read) {
    return read.kind == LayerArg::Kind::kActivation && read.index < layers.size() &&
           layers[read.index].exchanges(static_cast<size_t>(read.output)) &&
           layers[read.index].exchanged_outputs[static_cast<size_t>(read.output)] ==
               ExchangeLayout::kRingNext;
  };
  LayerArg read = layers[l].forward_args[arg];
  Rotated rotated;
  // Back through hand-on layers, each a rotation, to the block the first one read as it is.
  while (rotates(read) && layers[read.index].hands_on_rotation) {
    ++rotated.rotations;
    read = layers[read.index].forward_args.front();
  }
  if (rotated.rotations == 0 || rotates(read) || read.kind != LayerArg::Kind::kActivation) {
    return std::nullopt;  // not rotated, or rotated by a layer that is not a hand-on one
  }
  rotated.origin_layer = read.index;
  rotated.origin_output = read.output;
  return rotated;
}

const char* SequenceAttentionName(SequenceAttention attention) {
  switch (attention) {
    case SequenceAttention::kRing:
      return "ring";
    case SequenceAttention::kHalo:
      return "halo";
    case SequenceAttention::kUlysses:
      break;
  }
  return "ulysses";
}

Result<ModelSpec> ModelSpec::SplitForSequenceParallel(int ranks,
                                                      SequenceAttention attention) const {
  if (sequence_parallel > 1 && ranks == sequence_parallel && sequence_attention != attention) {
    return InvalidArgument(
        "model '{}' is split over {} sequence ranks attending by {}, not {}; split the whole "
        "model",
        name, ranks, SequenceAttentionName(sequence_attention), SequenceAttentionName(attention));
  }
  if (attention == SequenceAttention::kRing || attention == SequenceAttention::kHalo) {
    const Rewrite rewrite =
        attention == SequenceAttention::kRing
            ? Rewrite{"sequence", &ModelSpec::sequence_parallel, split_for_ring_attention,
                      "does not say how its attention rotates keys and values around "
                      "sequence ranks (model/model.h: ModelBuilder::SplitSequenceOver with "
                      "SequenceAttention::kRing), so it cannot run ring attention: use "
                      "--sequence-parallel ulysses or none"}
            : Rewrite{"spatial", &ModelSpec::sequence_parallel, split_into_slabs,
                      "does not say how its volumes split into slabs (ModelSpec::"
                      "split_into_slabs), so it cannot run spatially parallel: use "
                      "--spatial-parallel 1"};
    TESSERA_ASSIGN_OR_RETURN(ModelSpec split, Rewritten(*this, ranks, rewrite));
    if (ranks > 1 && split.sequence_attention != attention) {
      return Internal("model '{}' split for {} says it attends by {}", name,
                      SequenceAttentionName(attention),
                      SequenceAttentionName(split.sequence_attention));
    }
    return split;
  }
  return Rewritten(*this, ranks,
                   Rewrite{"sequence", &ModelSpec::sequence_parallel, split_for_sequence_parallel,
                           "does not say how its layers split a sequence over ranks "
                           "(model/model.h: ModelBuilder::SplitSequenceOver, "
                           "LayerBuilder::Exchange), so it cannot run sequence parallel: use "
                           "--sequence-parallel none"});
}

Result<ModelSpec> ModelSpec::PlannedFor(int tensor_ranks, int sequence_ranks, bool shard_sequence,
                                        SequenceAttention attention) const {
  if (tensor_ranks > 1 && sequence_ranks > 1) {
    return InvalidArgument(
        "tensor parallelism ({} ranks) and sequence parallelism ({} ranks) together are not "
        "built: use one of them (data and pipeline parallelism compose with either)",
        tensor_ranks, sequence_ranks);
  }
  if (sequence_ranks > 1 || sequence_parallel > 1) {
    return SplitForSequenceParallel(sequence_ranks, attention);
  }
  return SplitForTensorParallel(tensor_ranks, shard_sequence);
}

Result<ModelSpec> ModelSpec::OneRankView() const {
  if (shards_sequence || (sequence_parallel > 1 && slabs() == 1)) {
    return InvalidArgument(
        "model '{}' split {}: its collectives change the shapes its layers read, so one rank "
        "does not run on its own; time its tensor split without sequence sharding",
        name,
        shards_sequence ? "sharding sequences (Megatron-LM's sequence parallelism)"
                        : fmt::format("over {} sequence ranks", sequence_parallel));
  }
  ModelSpec view = *this;
  view.tensor_parallel = 1;
  view.sequence_parallel = 1;
  view.sequence_attention = SequenceAttention::kUlysses;
  view.split_into_slabs = nullptr;
  view.split_for_tensor_parallel = nullptr;
  view.split_sharding_sequence = nullptr;
  view.split_for_sequence_parallel = nullptr;
  view.split_for_ring_attention = nullptr;
  for (LayerSpec& layer : view.layers) {
    layer.tensor_parallel.reset();
    layer.exchanged_outputs.clear();  // halos and statistics keep their shapes
  }
  for (ModelInput& input : view.inputs) input.split_axis = -1;
  return view;
}

namespace {

// Readers read a collective's result in place of the outputs `replaced` names (partial sums,
// exchanged values), so the layer's backward must not keep them: it would read the result's
// parts, not what it made.
Status RefuseKeptOutputs(const LayerSpec& layer, const char* what,
                         const std::function<bool(size_t)>& replaced) {
  for (const BackwardArg& arg : layer.backward_args) {
    if (arg.kind == BackwardArg::Kind::kForwardOutput && replaced(arg.index)) {
      return InvalidArgument(
          "layer '{}' keeps its {} output {} for its backward: keep what it is made of instead",
          layer.name, what, arg.index);
    }
  }
  return Status::Ok();
}

// A sequence-parallel model's layer: its exchanged outputs are activations not kept for its
// backward, rotated around the ring only in a model attending by ring attention, passed as halos
// only between slabs, and exchanged in the sequence orders only in one attending by Ulysses.
Status ValidateSequenceLayer(const LayerSpec& layer, int ranks, SequenceAttention attention) {
  if (layer.hands_on_rotation &&
      (layer.activations != 1 || !layer.exchanges(0) ||
       layer.exchanged_outputs[0] != ExchangeLayout::kRingNext || layer.forward_args.empty() ||
       layer.forward_args.front().kind != LayerArg::Kind::kActivation)) {
    return InvalidArgument(
        "layer '{}' hands a rotation on, so its one output must be its input 0 (an activation) "
        "rotated in ring_next",
        layer.name);
  }
  if (layer.exchanged_outputs.empty()) return Status::Ok();
  if (ranks == 1) {
    return InvalidArgument("layer '{}' exchanges outputs but the model splits no sequence",
                           layer.name);
  }
  if (layer.exchanged_outputs.size() != static_cast<size_t>(layer.activations)) {
    return InvalidArgument("layer '{}' says whether {} output(s) are exchanged but has {}",
                           layer.name, layer.exchanged_outputs.size(), layer.activations);
  }
  for (size_t o = 0; o < layer.exchanged_outputs.size(); ++o) {
    const ExchangeLayout layout = layer.exchanged_outputs[o];
    // Rings only under ring attention, halos only between slabs, the sequence orders only under
    // Ulysses; blocks anywhere but a ring.
    const bool fits = layout == ExchangeLayout::kNone ||
                      (RotatesRing(layout)  ? attention == SequenceAttention::kRing
                       : PassesHalo(layout) ? attention == SequenceAttention::kHalo
                                            : (layout == ExchangeLayout::kBlocks
                                                   ? attention != SequenceAttention::kRing
                                                   : attention == SequenceAttention::kUlysses));
    if (!fits) {
      return InvalidArgument(
          "layer '{}' exchanges output {} in layout {}, but the model attends by {} "
          "(ModelBuilder::SplitSequenceOver)",
          layer.name, o, ExchangeLayoutName(layout), SequenceAttentionName(attention));
    }
  }
  TESSERA_RETURN_IF_ERROR(
      RefuseKeptOutputs(layer, "exchanged", [&](size_t o) { return layer.exchanges(o); }));
  if (layer.loss && layer.exchanges(0)) {
    return InvalidArgument("the loss layer '{}' cannot exchange its loss", layer.name);
  }
  return Status::Ok();
}

// Megatron sequence parallelism's marks on a split layer (`tp`, its TensorParallelLayer): only in
// a model sharding the sequence; a scattered output is a partial sum, a gathered one is not; a
// sharded layer holds its parameters whole.
Status ValidateSequenceShards(const LayerSpec& layer, const TensorParallelLayer& tp,
                              bool shards_sequence) {
  const bool marked =
      !tp.scattered_outputs.empty() || !tp.gathered_outputs.empty() || tp.sequence_sharded;
  if (marked && !shards_sequence) {
    return InvalidArgument(
        "layer '{}' shards or gathers the sequence but the model does not shard it "
        "(ModelSpec::shards_sequence)",
        layer.name);
  }
  const auto sized = [&](const std::vector<bool>& marks) {
    return marks.empty() || marks.size() == static_cast<size_t>(layer.activations);
  };
  if (!sized(tp.scattered_outputs) || !sized(tp.gathered_outputs)) {
    return InvalidArgument(
        "layer '{}' says whether {} and {} output(s) are scattered and gathered but has {}",
        layer.name, tp.scattered_outputs.size(), tp.gathered_outputs.size(), layer.activations);
  }
  for (size_t o = 0; o < static_cast<size_t>(layer.activations); ++o) {
    const bool partial = o < tp.partial_outputs.size() && tp.partial_outputs[o];
    if (tp.scatters(o) && !partial) {
      return InvalidArgument(
          "layer '{}' output {} is reduce-scattered along the sequence but is not a partial sum",
          layer.name, o);
    }
    if (tp.gathers(o) && (partial || tp.scatters(o))) {
      return InvalidArgument(
          "layer '{}' output {} is all-gathered along the sequence, so it must be whole and "
          "unscattered",
          layer.name, o);
    }
  }
  if (tp.sequence_sharded) {
    for (size_t s = 0; s < tp.slots.size(); ++s) {
      if (!tp.slots[s].replicated()) {
        return InvalidArgument(
            "layer '{}' runs on 1/T of the positions but splits slot {}: a layer sharding the "
            "sequence holds its parameters whole",
            layer.name, s);
      }
    }
  }
  return RefuseKeptOutputs(layer, "gathered", [&](size_t o) { return tp.gathers(o); });
}

// A split model's layer: its TensorParallelLayer sized to its slots, outputs and arguments.
Status ValidateSplitLayer(const LayerSpec& layer) {
  if (!layer.tensor_parallel) {
    return InvalidArgument("layer '{}' of a split model does not say how it is split", layer.name);
  }
  const TensorParallelLayer& tp = *layer.tensor_parallel;
  const auto& slots = layer.params.slots();
  if (tp.slots.size() != slots.size() ||
      tp.partial_outputs.size() != static_cast<size_t>(layer.activations) ||
      tp.partial_input_gradients.size() != layer.forward_args.size()) {
    return InvalidArgument(
        "layer '{}' says how {} slot(s), {} output(s) and {} argument(s) split, but has {}, {} "
        "and {}",
        layer.name, tp.slots.size(), tp.partial_outputs.size(), tp.partial_input_gradients.size(),
        slots.size(), layer.activations, layer.forward_args.size());
  }
  for (size_t s = 0; s < slots.size(); ++s) {
    const SlotSplit& split = tp.slots[s];
    if (!split.replicated() && (split.dim >= slots[s].shape.rank() || split.blocks < 1 ||
                                slots[s].shape[split.dim] % split.blocks != 0)) {
      return InvalidArgument(
          "layer '{}' slot '{}' of shape {} cannot split along dimension {} in {} block(s)",
          layer.name, slots[s].name, slots[s].shape.ToString(), split.dim, split.blocks);
    }
  }
  for (size_t a = 0; a < layer.forward_args.size(); ++a) {
    if (tp.partial_input_gradients[a] &&
        layer.forward_args[a].kind != LayerArg::Kind::kActivation) {
      return InvalidArgument(
          "layer '{}' argument {} has a partial gradient but is not an activation", layer.name, a);
    }
  }
  TESSERA_RETURN_IF_ERROR(RefuseKeptOutputs(layer, "partial", [&](size_t o) {
    return o < tp.partial_outputs.size() && tp.partial_outputs[o];
  }));
  if (layer.loss && !tp.partial_outputs.empty() && tp.partial_outputs[0]) {
    return InvalidArgument("the loss layer '{}' cannot return a partial loss", layer.name);
  }
  return Status::Ok();
}

}  // namespace

Status ModelSpec::Validate() const {
  TESSERA_RETURN_IF_ERROR(LossLayer().status());
  if (tensor_parallel < 1 || sequence_parallel < 1) {
    return InvalidArgument("model '{}' is split over {} tensor / {} sequence ranks", name,
                           tensor_parallel, sequence_parallel);
  }
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerSpec& layer = layers[l];
    if (tensor_parallel > 1) {
      TESSERA_RETURN_IF_ERROR(ValidateSplitLayer(layer));
      if (layer.tensor_parallel.has_value()) {
        TESSERA_RETURN_IF_ERROR(
            ValidateSequenceShards(layer, *layer.tensor_parallel, shards_sequence));
      }
    }
    TESSERA_RETURN_IF_ERROR(ValidateSequenceLayer(layer, sequence_parallel, sequence_attention));
    if (layer.loss && l + 1 != layers.size()) {
      return InvalidArgument("layer '{}' computes the loss but is not the last layer", layer.name);
    }
    if (layer.forward_args.empty()) {
      return InvalidArgument("layer '{}' reads nothing", layer.name);
    }
    if (!layer.init.empty() && layer.init.size() != layer.params.slots().size()) {
      return InvalidArgument(
          "layer '{}' says how {} parameter tensor(s) start but has {}: give one ParamInit per "
          "slot, or none (zeros)",
          layer.name, layer.init.size(), layer.params.slots().size());
    }
    if (layer.backward_input_op.empty() != layer.backward_weight_op.empty()) {
      return InvalidArgument(
          "layer '{}' names only one half of a split backward (input: '{}', weight: '{}'): name "
          "both or neither",
          layer.name, layer.backward_input_op, layer.backward_weight_op);
    }

    for (size_t a = 0; a < layer.forward_args.size(); ++a) {
      const LayerArg& arg = layer.forward_args[a];
      switch (arg.kind) {
        case LayerArg::Kind::kModelInput:
          if (arg.index >= inputs.size()) {
            return InvalidArgument("layer '{}' argument {} reads model input {}, but there are {}",
                                   layer.name, a, arg.index, inputs.size());
          }
          break;
        case LayerArg::Kind::kActivation:
          if (arg.index >= l) {
            return InvalidArgument(
                "layer '{}' argument {} reads layer {} ('{}'), which is not before it: layers "
                "must be in forward order and form no cycle",
                layer.name, a, arg.index, arg.index < layers.size() ? layers[arg.index].name : "?");
          }
          if (arg.output < 0 || arg.output >= layers[arg.index].activations) {
            return InvalidArgument("layer '{}' argument {} reads output {} of '{}', which has {}",
                                   layer.name, a, arg.output, layers[arg.index].name,
                                   layers[arg.index].activations);
          }
          // A gathered value's gradient is summed by its gather's adjoint: its readers' must be
          // partial sums.
          if (ReadsGathered(layer, a) && layer.tensor_parallel.has_value() &&
              !layer.tensor_parallel->partial_input_gradients[a]) {
            return InvalidArgument(
                "layer '{}' argument {} reads the all-gathered output {} of '{}' but its gradient "
                "is not a partial sum (LayerBuilder::PartialGradient): the gather's reduce-scatter "
                "would sum whole gradients",
                layer.name, a, arg.output, layers[arg.index].name);
          }
          break;
        case LayerArg::Kind::kParams:
          if (arg.index > l) {
            return InvalidArgument("layer '{}' reads the parameters of a later layer ('{}')",
                                   layer.name,
                                   arg.index < layers.size() ? layers[arg.index].name : "?");
          }
          break;
      }
    }
    for (const BackwardArg& arg : layer.backward_args) {
      const bool output = arg.kind == BackwardArg::Kind::kOutputGradient;
      if (output && (layer.loss || arg.index >= static_cast<size_t>(layer.activations))) {
        return InvalidArgument("layer '{}' backward reads the gradient of output {}", layer.name,
                               arg.index);
      }
      if (!output && arg.kind != BackwardArg::Kind::kForwardOutput &&
          arg.index >= layer.forward_args.size()) {
        return InvalidArgument("layer '{}' backward reads forward argument {}, but there are {}",
                               layer.name, arg.index, layer.forward_args.size());
      }
      if (arg.kind == BackwardArg::Kind::kGradientSoFar &&
          layer.forward_args[arg.index].kind != LayerArg::Kind::kParams) {
        return InvalidArgument(
            "layer '{}' backward adds to the gradient of an argument that is "
            "not a parameter group",
            layer.name);
      }
    }
    for (size_t target : layer.backward_outputs) {
      if (target >= layer.forward_args.size() ||
          layer.forward_args[target].kind == LayerArg::Kind::kModelInput) {
        return InvalidArgument(
            "layer '{}' backward returns a gradient of forward argument {}, which is not an "
            "activation or parameters",
            layer.name, target);
      }
    }
  }
  return Status::Ok();
}

}  // namespace tessera
