#include "model/model.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

namespace tessera {

// ---- LayerBuilder ----

LayerBuilder::LayerBuilder(const OpRegistry& registry, int inputs, int tensor_parallel)
    : registry_(registry), tensor_parallel_(tensor_parallel), values_(inputs) {
  program_.inputs = inputs;
}

LayerValue LayerBuilder::input(int i) {
  if (i < 0 || i >= program_.inputs) {
    errors_.push_back(
        fmt::format("reads input {}, but the layer was given {} input(s)", i, program_.inputs));
    return LayerValue{};
  }
  return LayerValue{i};
}

LayerValue LayerBuilder::Param(std::string name, Shape shape, ParamInit init, bool decay) {
  if (!program_.ops.empty()) {
    errors_.push_back(fmt::format(
        "declares parameter '{}' after its first op: declare every parameter first", name));
    return LayerValue{};
  }
  if (!shared_.empty()) {
    errors_.push_back(
        fmt::format("declares parameter '{}' after a shared parameter: declare its own "
                    "parameters first",
                    name));
    return LayerValue{};
  }
  for (const FlatSlot& slot : program_.params.slots()) {
    if (slot.name == name) {
      errors_.push_back(fmt::format("declares parameter '{}' twice", name));
      return LayerValue{};
    }
  }
  for (int64_t d : shape.dims()) {
    if (d <= 0) {
      errors_.push_back(
          fmt::format("parameter '{}' has shape {}: every dimension must be "
                      "positive",
                      name, shape.ToString()));
      return LayerValue{};
    }
  }
  program_.params.Add(std::move(name), std::move(shape), decay);
  init_.push_back(init);
  splits_.push_back(SlotSplit{});
  return LayerValue{values_++};
}

LayerValue LayerBuilder::SlicedParam(std::string name, Shape whole, SlotSplit split, ParamInit init,
                                     bool decay) {
  if (split.replicated()) return Param(std::move(name), std::move(whole), init, decay);
  const int64_t parts = split.blocks * tensor_parallel_;
  if (split.dim >= whole.rank() || split.blocks < 1 || whole[split.dim] % parts != 0) {
    errors_.push_back(fmt::format(
        "parameter '{}' of shape {} cannot split along dimension {} into {} block(s) of {} "
        "part(s): use a tensor-parallel degree that divides {}",
        name, whole.ToString(), split.dim, split.blocks, tensor_parallel_,
        split.dim < whole.rank() ? whole[split.dim] / std::max<int64_t>(split.blocks, 1) : 0));
    return LayerValue{};
  }
  std::vector<int64_t> dims = whole.dims();
  dims[static_cast<size_t>(split.dim)] /= tensor_parallel_;
  LayerValue value = Param(std::move(name), Shape(std::move(dims)), init, decay);
  if (value.id >= 0) splits_.back() = split;
  return value;
}

void LayerBuilder::PartialSum(LayerValue value) { partial_values_.push_back(value.id); }

void LayerBuilder::PartialGradient(int i) {
  if (i < 0 || i >= program_.inputs) {
    errors_.push_back(fmt::format("marks the gradient of input {} partial, but the layer has {}", i,
                                  program_.inputs));
    return;
  }
  partial_inputs_.push_back(i);
}

LayerValue LayerBuilder::SharedParam(std::string layer, std::string param) {
  if (!program_.ops.empty()) {
    errors_.push_back(fmt::format(
        "reads parameter '{}' of layer '{}' after its first op: declare every parameter first",
        param, layer));
    return LayerValue{};
  }
  const int first = program_.inputs + static_cast<int>(program_.params.slots().size());
  for (size_t i = 0; i < shared_.size(); ++i) {
    if (shared_[i].first == layer && shared_[i].second == param) {
      return LayerValue{first + static_cast<int>(i)};
    }
  }
  shared_.emplace_back(std::move(layer), std::move(param));
  return LayerValue{values_++};
}

std::vector<LayerValue> LayerBuilder::CallAll(std::string op, const std::vector<LayerValue>& inputs,
                                              Attrs attrs, std::string label) {
  Result<const OpDef*> def = registry_.Find(op);
  if (!def.ok()) {
    errors_.push_back(def.status().message());
    return {};
  }
  ProgramOp call{.op = std::move(op), .attrs = std::move(attrs), .label = std::move(label)};
  for (const LayerValue& v : inputs) {
    if (v.id < 0 || v.id >= values_) {
      errors_.push_back(
          fmt::format("op '{}' reads a value that is not of this layer (or came "
                      "from an earlier error)",
                      call.op));
      return {};
    }
    call.inputs.push_back(v.id);
  }
  // The op's declared outputs; a variadic-output op is not one a layer can call.
  call.outputs = static_cast<int>((*def)->output_names.size());
  if ((*def)->variadic_outputs) {
    errors_.push_back(fmt::format("op '{}' cannot be called inside a layer", call.op));
    return {};
  }
  std::vector<LayerValue> outputs;
  outputs.reserve(static_cast<size_t>(call.outputs));
  for (int o = 0; o < call.outputs; ++o) outputs.push_back(LayerValue{values_++});
  program_.ops.push_back(std::move(call));
  return outputs;
}

LayerValue LayerBuilder::Call(std::string op, const std::vector<LayerValue>& inputs, Attrs attrs,
                              std::string label) {
  std::vector<LayerValue> outputs =
      CallAll(std::move(op), inputs, std::move(attrs), std::move(label));
  return outputs.empty() ? LayerValue{} : outputs[0];
}

// ---- ModelBuilder ----

ModelBuilder::ModelBuilder(std::string name, const OpRegistry& registry)
    : name_(std::move(name)), registry_(registry) {}

ModelValue ModelBuilder::Input(std::string name, DType dtype, Shape example, bool label) {
  inputs_.push_back(ModelInput{
      .name = std::move(name), .dtype = dtype, .shape = std::move(example), .label = label});
  return ModelValue{.input = static_cast<int>(inputs_.size()) - 1};
}

ModelValue ModelBuilder::SequenceInput(std::string name, DType dtype, Shape example, bool label) {
  ModelValue value = Input(std::move(name), dtype, std::move(example), label);
  inputs_.back().sequence = true;
  return value;
}

ModelValue ModelBuilder::LayerOutput(std::string layer, int output) {
  return ModelValue{.layer = std::move(layer), .output = output};
}

void ModelBuilder::Declare(std::string name, std::vector<ModelValue> inputs, const LayerFn& define,
                           bool loss) {
  LayerBuilder builder(registry_, static_cast<int>(inputs.size()), tensor_parallel_);
  std::vector<LayerValue> outputs = define(builder);
  DeclaredLayer layer{.name = std::move(name), .inputs = std::move(inputs), .loss = loss};
  layer.errors = std::move(builder.errors_);
  for (const LayerValue& v : outputs) {
    if (v.id < 0 || v.id >= builder.values_) {
      layer.errors.push_back("returns a value that is not of this layer");
      break;
    }
    builder.program_.outputs.push_back(v.id);
    layer.partial_outputs.push_back(std::find(builder.partial_values_.begin(),
                                              builder.partial_values_.end(),
                                              v.id) != builder.partial_values_.end());
    ExchangeLayout exchange = ExchangeLayout::kNone;
    for (const auto& [id, layout] : builder.exchanged_values_) {
      if (id == v.id) exchange = layout;
    }
    layer.exchanged_outputs.push_back(exchange);
    const auto marked = [&](const std::vector<int>& ids) {
      return std::find(ids.begin(), ids.end(), v.id) != ids.end();
    };
    layer.scattered_outputs.push_back(marked(builder.scattered_values_));
    layer.gathered_outputs.push_back(marked(builder.gathered_values_));
  }
  layer.sequence_sharded = builder.sequence_sharded_;
  layer.hands_on_rotation = builder.hands_on_rotation_;
  if (!shard_sequence_ && (!builder.scattered_values_.empty() ||
                           !builder.gathered_values_.empty() || builder.sequence_sharded_)) {
    layer.errors.push_back(
        "shards the sequence, but the model is not split with shard_sequence (ModelBuilder::"
        "SplitOver)");
  }
  layer.partial_inputs.assign(layer.inputs.size(), false);
  for (int i : builder.partial_inputs_) layer.partial_inputs[static_cast<size_t>(i)] = true;
  layer.splits = std::move(builder.splits_);
  if (outputs.empty()) layer.errors.push_back("returns no output");
  if (loss && outputs.size() != 1) {
    layer.errors.push_back(
        fmt::format("is the loss, so it returns one output (the loss), not {}", outputs.size()));
  }
  builder.program_.loss = loss;
  layer.program = std::move(builder.program_);
  layer.init = std::move(builder.init_);
  layer.shared = std::move(builder.shared_);
  layers_.push_back(std::move(layer));
}

ModelValue ModelBuilder::Layer(std::string name, std::vector<ModelValue> inputs,
                               SingleOutputLayerFn define) {
  ModelValue value = LayerOutput(name);
  Declare(
      std::move(name), std::move(inputs),
      [&](LayerBuilder& l) { return std::vector<LayerValue>{define(l)}; }, /*loss=*/false);
  return value;
}

void ModelBuilder::LayerWithOutputs(std::string name, std::vector<ModelValue> inputs,
                                    const LayerFn& define) {
  Declare(std::move(name), std::move(inputs), define, /*loss=*/false);
}

void ModelBuilder::Loss(std::string name, std::vector<ModelValue> inputs,
                        SingleOutputLayerFn define) {
  Declare(
      std::move(name), std::move(inputs),
      [&](LayerBuilder& l) { return std::vector<LayerValue>{define(l)}; }, /*loss=*/true);
}

Result<LayerProgram> ModelBuilder::ResolveShared(const DeclaredLayer& layer,
                                                 const std::map<std::string, size_t>& by_name,
                                                 std::vector<size_t>& owners) const {
  LayerProgram program = layer.program;
  // Provisional value of each SharedParam call -> (group, slot); groups in order of first use.
  std::vector<std::pair<size_t, int>> where;
  for (const auto& [owner_name, param] : layer.shared) {
    auto it = by_name.find(owner_name);
    if (it == by_name.end()) {
      return InvalidArgument(
          "model '{}': layer '{}' reads parameter '{}' of layer '{}', which is not declared", name_,
          layer.name, param, owner_name);
    }
    const DeclaredLayer& owner = layers_[it->second];
    if (owner_name == layer.name) {
      return InvalidArgument(
          "model '{}': layer '{}' reads its own parameter '{}' as shared: use "
          "the value Param returned",
          name_, layer.name, param);
    }
    if (owner.loss) {
      return InvalidArgument("model '{}': layer '{}' reads parameter '{}' of the loss layer '{}'",
                             name_, layer.name, param, owner_name);
    }
    const std::vector<FlatSlot>& slots = owner.program.params.slots();
    auto slot = std::find_if(slots.begin(), slots.end(),
                             // `&param = param`: Clang 15 cannot capture a binding.
                             [&param = param](const FlatSlot& s) { return s.name == param; });
    if (slot == slots.end()) {
      std::vector<std::string> names;
      names.reserve(slots.size());
      for (const FlatSlot& s : slots) names.push_back(s.name);
      return InvalidArgument(
          "model '{}': layer '{}' reads parameter '{}' of layer '{}', which has no parameter of "
          "that name (it has: {})",
          name_, layer.name, param, owner_name,
          names.empty() ? std::string("none") : fmt::format("{}", fmt::join(names, ", ")));
    }
    size_t group = 0;
    while (group < owners.size() && owners[group] != it->second) ++group;
    if (group == owners.size()) {
      owners.push_back(it->second);
      program.shared.push_back(SharedGroup{.layer = owner_name, .params = owner.program.params});
    }
    program.shared[group].slots.push_back(static_cast<int>(slot - slots.begin()));
    where.emplace_back(group, static_cast<int>(program.shared[group].slots.size()) - 1);
  }
  // Renumber the shared values from call order to group order.
  const int first = program.inputs + static_cast<int>(program.params.slots().size());
  auto renumber = [&](int& value) {
    if (value < first || value >= first + static_cast<int>(where.size())) return;
    const auto& [group, index] = where[static_cast<size_t>(value - first)];
    value = program.first_shared(group) + index;
  };
  for (ProgramOp& op : program.ops) {
    for (int& value : op.inputs) renumber(value);
  }
  for (int& value : program.outputs) renumber(value);
  return program;
}

Result<ModelSpec> ModelBuilder::Build() const {
  Resolved resolved;
  TESSERA_ASSIGN_OR_RETURN(resolved.by_name, IndexLayers());
  TESSERA_ASSIGN_OR_RETURN(resolved.producers, ProducersOf(resolved.by_name));
  // Each layer's program with its shared groups; their owners run first.
  resolved.programs.reserve(layers_.size());
  resolved.owners.resize(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    TESSERA_ASSIGN_OR_RETURN(LayerProgram program,
                             ResolveShared(layers_[i], resolved.by_name, resolved.owners[i]));
    resolved.programs.push_back(std::move(program));
    for (size_t owner : resolved.owners[i]) resolved.producers[i].push_back(owner);
  }
  TESSERA_ASSIGN_OR_RETURN(resolved.order, Order(resolved.producers));
  resolved.index_of.resize(layers_.size());
  for (size_t k = 0; k < resolved.order.size(); ++k) resolved.index_of[resolved.order[k]] = k;
  resolved.output_metas.resize(layers_.size());

  ModelSpec model;
  model.name = name_;
  model.inputs = inputs_;
  model.tensor_parallel = tensor_parallel_;
  model.shards_sequence = shard_sequence_ && tensor_parallel_ > 1;
  model.sequence_parallel = sequence_parallel_;
  model.sequence_attention = sequence_attention_;
  model.layers.reserve(resolved.order.size());
  for (size_t k = 0; k < resolved.order.size(); ++k) {
    TESSERA_ASSIGN_OR_RETURN(LayerSpec layer, SpecOf(k, resolved));
    model.layers.push_back(std::move(layer));
  }
  TESSERA_RETURN_IF_ERROR(model.Validate());
  return model;
}

Result<std::map<std::string, size_t>> ModelBuilder::IndexLayers() const {
  std::map<std::string, size_t> by_name;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DeclaredLayer& layer = layers_[i];
    if (!layer.errors.empty()) {
      return InvalidArgument("model '{}': layer '{}' {}", name_, layer.name,
                             fmt::join(layer.errors, "; "));
    }
    if (!by_name.emplace(layer.name, i).second) {
      return InvalidArgument("model '{}' has two layers named '{}'", name_, layer.name);
    }
  }
  size_t losses = 0;
  for (const DeclaredLayer& layer : layers_) losses += layer.loss ? 1 : 0;
  if (losses != 1) {
    return InvalidArgument("model '{}' has {} loss layers: declare exactly one with Loss()", name_,
                           losses);
  }
  return by_name;
}

Result<std::vector<std::vector<size_t>>> ModelBuilder::ProducersOf(
    const std::map<std::string, size_t>& by_name) const {
  std::vector<std::vector<size_t>> producers(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    for (const ModelValue& input : layers_[i].inputs) {
      if (input.layer.empty()) {
        if (input.input < 0 || input.input >= static_cast<int>(inputs_.size())) {
          return InvalidArgument("model '{}': layer '{}' reads a model input that does not exist",
                                 name_, layers_[i].name);
        }
        continue;
      }
      auto it = by_name.find(input.layer);
      if (it == by_name.end()) {
        return InvalidArgument("model '{}': layer '{}' reads layer '{}', which is not declared",
                               name_, layers_[i].name, input.layer);
      }
      if (layers_[it->second].loss) {
        return InvalidArgument("model '{}': layer '{}' reads the loss layer '{}'", name_,
                               layers_[i].name, input.layer);
      }
      producers[i].push_back(it->second);
    }
  }
  return producers;
}

Result<std::vector<size_t>> ModelBuilder::Order(
    const std::vector<std::vector<size_t>>& producers) const {
  // Declaration order among the ready; what is left is on or behind a cycle.
  std::vector<size_t> order;
  std::vector<bool> placed(layers_.size(), false);
  const auto ready = [&](size_t i) {
    return std::all_of(producers[i].begin(), producers[i].end(),
                       [&](size_t p) { return placed[p]; });
  };
  while (order.size() < layers_.size()) {
    bool progress = false;
    for (size_t i = 0; i < layers_.size(); ++i) {
      if (placed[i] || layers_[i].loss) continue;
      if (ready(i)) {
        placed[i] = true;
        order.push_back(i);
        progress = true;
        break;
      }
    }
    if (progress) continue;
    const size_t loss = static_cast<size_t>(
        std::find_if(layers_.begin(), layers_.end(), [](const auto& l) { return l.loss; }) -
        layers_.begin());
    if (!placed[loss] && ready(loss) && order.size() + 1 == layers_.size()) {
      placed[loss] = true;
      order.push_back(loss);
      continue;
    }
    std::vector<std::string> stuck;
    for (size_t i = 0; i < layers_.size(); ++i) {
      if (!placed[i] && !layers_[i].loss) stuck.push_back(layers_[i].name);
    }
    return InvalidArgument(
        "model '{}' has a cycle: layers {} read each other's outputs (directly or through "
        "others); a layer may only read layers that do not depend on it",
        name_, fmt::join(stuck, ", "));
  }
  return order;
}

Result<LayerSpec> ModelBuilder::SpecOf(size_t k, Resolved& resolved) const {
  const size_t i = resolved.order[k];
  const DeclaredLayer& declared = layers_[i];
  LayerProgram program = resolved.programs[i];
  LayerSpec layer;
  layer.name = declared.name;
  layer.params = program.params;
  layer.init = declared.init;
  layer.forward_op = "layer_forward";
  layer.backward_op = "layer_backward";
  layer.backward_input_op = "layer_backward_input";
  layer.backward_weight_op = "layer_backward_weight";
  layer.loss = declared.loss;
  std::vector<TensorMeta> metas;
  TESSERA_RETURN_IF_ERROR(AddInputArgs(declared, resolved, layer, program, metas));
  Result<ProgramShapes> shapes = InferProgram(registry_, program, metas);
  if (!shapes.ok()) {
    return shapes.status().WithContext(fmt::format("model '{}': layer '{}'", name_, declared.name));
  }
  for (size_t o = 0; o < program.outputs.size(); ++o) {
    TensorMeta meta = shapes->values[static_cast<size_t>(program.outputs[o])];
    // Readers of an exchanged output read what the all-to-all makes of it.
    const ExchangeLayout exchange = o < declared.exchanged_outputs.size()
                                        ? declared.exchanged_outputs[o]
                                        : ExchangeLayout::kNone;
    if (exchange != ExchangeLayout::kNone) {
      Result<std::vector<int64_t>> dims =
          ExchangedDims(meta.shape.dims(), exchange, sequence_parallel_);
      if (!dims.ok()) {
        return dims.status().WithContext(
            fmt::format("model '{}': layer '{}' output {}", name_, declared.name, o));
      }
      meta.shape = Shape(*std::move(dims));
    }
    // Readers of a scattered or gathered output read 1/T of its positions, or T times as many.
    const bool scattered = o < declared.scattered_outputs.size() && declared.scattered_outputs[o];
    const bool gathered = o < declared.gathered_outputs.size() && declared.gathered_outputs[o];
    if (scattered || gathered) {
      Result<std::vector<int64_t>> dims =
          SequenceSplitDims(meta.shape.dims(), tensor_parallel_, /*gather=*/gathered);
      if (!dims.ok()) {
        return dims.status().WithContext(
            fmt::format("model '{}': layer '{}' output {}", name_, declared.name, o));
      }
      meta.shape = Shape(*std::move(dims));
    }
    resolved.output_metas[i].push_back(meta);
  }
  if (program.params.numel() > 0) {
    layer.forward_args.push_back(LayerArg{LayerArg::Kind::kParams, k, 0});
  }
  // The shared groups' arguments, after the layer's own group.
  const size_t first_shared = layer.forward_args.size();
  for (size_t owner : resolved.owners[i]) {
    layer.forward_args.push_back(LayerArg{LayerArg::Kind::kParams, resolved.index_of[owner], 0});
  }
  layer.activations = static_cast<int>(program.outputs.size());
  if (tensor_parallel_ > 1) {
    TensorParallelLayer split{.slots = declared.splits,
                              .partial_outputs = declared.partial_outputs,
                              .partial_input_gradients = declared.partial_inputs};
    split.partial_input_gradients.resize(layer.forward_args.size(), false);
    if (shard_sequence_) {
      split.scattered_outputs = declared.scattered_outputs;
      split.gathered_outputs = declared.gathered_outputs;
      split.sequence_sharded = declared.sequence_sharded;
    }
    layer.tensor_parallel = std::move(split);
  }
  if (std::any_of(declared.exchanged_outputs.begin(), declared.exchanged_outputs.end(),
                  [](ExchangeLayout layout) { return layout != ExchangeLayout::kNone; })) {
    layer.exchanged_outputs = declared.exchanged_outputs;
  }
  layer.hands_on_rotation = declared.hands_on_rotation;
  AddBackwardArgs(declared, program, first_shared, layer);
  layer.attrs.Set(kProgramAttr, program.Encode());
  return layer;
}

Status ModelBuilder::AddInputArgs(const DeclaredLayer& declared, const Resolved& resolved,
                                  LayerSpec& layer, LayerProgram& program,
                                  std::vector<TensorMeta>& metas) const {
  for (size_t a = 0; a < declared.inputs.size(); ++a) {
    const ModelValue& input = declared.inputs[a];
    if (input.layer.empty()) {
      const ModelInput& model_input = inputs_[static_cast<size_t>(input.input)];
      layer.forward_args.push_back(
          LayerArg{LayerArg::Kind::kModelInput, static_cast<size_t>(input.input), 0});
      metas.push_back(TensorMeta{model_input.shape, model_input.dtype, Device::Cpu()});
      continue;
    }
    const size_t producer = resolved.by_name.at(input.layer);
    const std::vector<TensorMeta>& produced = resolved.output_metas[producer];
    if (input.output < 0 || input.output >= static_cast<int>(produced.size())) {
      return InvalidArgument("model '{}': layer '{}' reads output {} of '{}', which has {}", name_,
                             declared.name, input.output, input.layer, produced.size());
    }
    layer.forward_args.push_back(
        LayerArg{LayerArg::Kind::kActivation, resolved.index_of[producer], input.output});
    metas.push_back(produced[static_cast<size_t>(input.output)]);
    if (CarriesGradients(metas.back().dtype)) {
      program.gradient_inputs.push_back(static_cast<int>(a));
    }
  }
  return Status::Ok();
}

void ModelBuilder::AddBackwardArgs(const DeclaredLayer& declared, const LayerProgram& program,
                                   size_t first_shared, LayerSpec& layer) {
  using B = BackwardArg::Kind;
  const bool has_params = program.params.numel() > 0;
  if (!declared.loss) {
    for (int o = 0; o < layer.activations; ++o) {
      layer.backward_args.push_back({B::kOutputGradient, static_cast<size_t>(o)});
    }
  }
  for (size_t a = 0; a < declared.inputs.size(); ++a) {
    layer.backward_args.push_back({B::kForwardArg, a});
  }
  layer.backward_args.push_back({B::kForwardOutput, static_cast<size_t>(layer.activations)});
  if (has_params) layer.backward_args.push_back({B::kForwardArg, declared.inputs.size()});
  for (size_t g = 0; g < program.shared.size(); ++g) {
    layer.backward_args.push_back({B::kForwardArg, first_shared + g});
  }
  for (int a : program.gradient_inputs) layer.backward_outputs.push_back(static_cast<size_t>(a));
  if (has_params) layer.backward_outputs.push_back(declared.inputs.size());
  for (size_t g = 0; g < program.shared.size(); ++g) {
    layer.backward_outputs.push_back(first_shared + g);
  }
}

}  // namespace tessera
