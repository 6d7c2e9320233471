// The model API: any model as a DAG of layers, each layer a small program of registered ops
// over its inputs and its own parameters. Nobody writes a backward: each op's gradient rule
// (OpDef::gradient) derives it, layer by layer (ops/layer_program.h). A built model is a
// ModelSpec, so every plan works on it as on GPT-2: data parallel, ZeRO stages 1-3, optimizer
// offload, micro-batches, clipping, checkpoints.
//
//   ModelBuilder mlp("mlp", registry);                              // the ops it may call
//   ModelValue x = mlp.Input("x", DType::kF32, Shape{1, 64});       // dimension 0: the batch
//   ModelValue y = mlp.Input("y", DType::kI32, Shape{1}, /*label=*/true);
//   ModelValue h = mlp.Layer("fc1", {x}, [](LayerBuilder& l) {
//     LayerValue w = l.Param("w", Shape{128, 64}, ParamInit::Normal(0.02), /*decay=*/true);
//     LayerValue b = l.Param("b", Shape{128}, ParamInit::Zeros());
//     return l.Call("gelu_forward", {l.Call("linear_forward", {l.input(0), w, b})});
//   });
//   ...
//   mlp.Loss("loss", {logits, y}, [](LayerBuilder& l) {
//     return l.Call("softmax_cross_entropy", {l.input(0), l.input(1)});
//   });
//   Result<ModelSpec> model = mlp.Build();
//
// Layers may read any earlier layer's output (skip connections), or a layer declared later by
// name (LayerOutput): Build orders the layers and refuses a cycle, naming the layers on it.
// A layer may also read another layer's parameter (SharedParam: GPT-2's classifier is the
// embedding's wte): the owner keeps it in its group, runs before the reader, and the group's
// gradient is the sum of both layers' parts.
// Shapes are inferred when the model is built, with the inputs' example shapes: an op given
// the wrong shapes is refused naming the layer, the op and the shapes. A layer's parameters are
// one flat group (what ZeRO shards), its tensors named "<layer>.<param>" in checkpoints.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/attrs.h"
#include "core/dtype.h"
#include "core/status.h"
#include "core/tensor.h"
#include "model/model_spec.h"
#include "ops/layer_program.h"
#include "ops/op_registry.h"

namespace tessera {

// A tensor inside a layer's definition: one of its inputs, a parameter, or an op's output.
struct LayerValue {
  int id = -1;
};

// Defines one layer's program. Errors (an unknown op, a value of another layer) are kept and
// reported by ModelBuilder::Build, so definitions read as plain code.
class LayerBuilder {
 public:
  // The layer's i-th input, in the order the layer was given them.
  LayerValue input(int i);
  // A parameter of the layer (f32), initialised by `init`; `decay`: AdamW decays it.
  // REQUIRES (else Build refuses): before the layer's shared parameters and first op.
  LayerValue Param(std::string name, Shape shape, ParamInit init, bool decay = false);
  // Parameter `param` of the layer named `layer` (another layer of the model, declared before
  // or after this one): read here, owned and initialised there. Build refuses an unknown
  // layer or parameter, naming them, and a layer reading its own or the loss layer's.
  // REQUIRES (else Build refuses): after the layer's own parameters, before its first op.
  LayerValue SharedParam(std::string layer, std::string param);
  // Tensor parallelism (model_spec.h's TensorParallelLayer), for a model built split over
  // tensor_parallel() ranks (ModelBuilder::SplitOver): a parameter this rank holds a slice of,
  // `whole` the whole model's shape and `split` which part is this rank's (the layer's program
  // sees the slice). Build refuses a dimension the ranks do not divide, naming it.
  // REQUIRES (else Build refuses): where Param may be called.
  LayerValue SlicedParam(std::string name, Shape whole, SlotSplit split, ParamInit init,
                         bool decay = false);
  // `value`, returned as an output, is each rank's partial sum: readers see the sum over ranks.
  void PartialSum(LayerValue value);
  // The gradient of input i that the backward returns is a partial sum over the ranks.
  void PartialGradient(int i);
  // Megatron-LM's sequence parallelism (ModelBuilder::SplitOver with shard_sequence;
  // TensorParallelLayer's marks): `value`, returned as an output, is a partial sum that readers
  // read reduce-scattered along the sequence, their 1/T of the positions ([B, S/T, ...]).
  void ScatterSum(LayerValue value) {
    PartialSum(value);
    scattered_values_.push_back(value.id);
  }
  // `value`, returned as an output, is this rank's 1/T of the positions: readers read it
  // all-gathered along the sequence ([B, S, ...]), and must declare their gradient of it partial.
  void GatherSequence(LayerValue value) { gathered_values_.push_back(value.id); }
  // The layer runs on this rank's 1/T of the positions (its replicated parameters' gradients are
  // summed over the ranks; its ops get attribute sequence_rank).
  void ShardSequence() { sequence_sharded_ = true; }
  // Sequence parallelism (ModelBuilder::SplitSequenceOver): `value`, returned as an output, is
  // read after an all-to-all over the sequence ranks in `layout` (LayerSpec::exchanged_outputs;
  // its readers see the shape the all-to-all makes).
  void Exchange(LayerValue value, ExchangeLayout layout = ExchangeLayout::kBlocks) {
    exchanged_values_.emplace_back(value.id, layout);
  }
  // Ring attention (ModelBuilder::SplitSequenceOver with kRing): the layer's only output is its
  // input 0, a rotated block of keys and values, handed on and rotated once more
  // (LayerSpec::hands_on_rotation). Call as the layer's whole program; returns the output.
  LayerValue HandOnRotation() {
    hands_on_rotation_ = true;
    const LayerValue rotated = Call("identity", {input(0)}, {}, "hand_on");
    Exchange(rotated, ExchangeLayout::kRingNext);
    return rotated;
  }
  // The ranks the model is built split over (1: the whole model).
  int tensor_parallel() const { return tensor_parallel_; }

  // Runs `op` on `inputs`: all its outputs.
  std::vector<LayerValue> CallAll(std::string op, const std::vector<LayerValue>& inputs,
                                  Attrs attrs = {}, std::string label = "");
  // Runs `op` on `inputs`: its first output.
  LayerValue Call(std::string op, const std::vector<LayerValue>& inputs, Attrs attrs = {},
                  std::string label = "");

 private:
  friend class ModelBuilder;
  LayerBuilder(const OpRegistry& registry, int inputs, int tensor_parallel);

  const OpRegistry& registry_;
  int tensor_parallel_ = 1;
  std::vector<SlotSplit> splits_;                                 // per parameter declared
  std::vector<int> partial_values_;                               // PartialSum's
  std::vector<int> partial_inputs_;                               // PartialGradient's
  std::vector<std::pair<int, ExchangeLayout>> exchanged_values_;  // Exchange's
  std::vector<int> scattered_values_, gathered_values_;           // ScatterSum's, GatherSequence's
  bool sequence_sharded_ = false;                                 // ShardSequence
  bool hands_on_rotation_ = false;                                // HandOnRotation
  LayerProgram program_;  // its shared groups are resolved by ModelBuilder::Build
  std::vector<ParamInit> init_;
  // SharedParam calls (layer, param), in order: values after the parameters, in this order.
  std::vector<std::pair<std::string, std::string>> shared_;
  int values_ = 0;
  std::vector<std::string> errors_;
};

// What a layer definition returns: its outputs, in order.
using LayerFn = std::function<std::vector<LayerValue>(LayerBuilder&)>;
using SingleOutputLayerFn = std::function<LayerValue(LayerBuilder&)>;

// A model input or a layer's output, as another layer reads it.
struct ModelValue {
  int input = -1;     // a model input, or
  std::string layer;  // a layer's
  int output = 0;     // output
};

class ModelBuilder {
 public:
  ModelBuilder(std::string name, const OpRegistry& registry);

  // A tensor fed each step. `example`: its shape, dimension 0 the batch (any value: the planner
  // sets the micro-batch). `label`: read by the loss only (targets), not fed when predicting.
  ModelValue Input(std::string name, DType dtype, Shape example, bool label = false);
  // A token-like input whose dimension 1 is the sequence: the plan's seq_len (at most
  // example[1]) replaces it, as for GPT-2's tokens and targets.
  ModelValue SequenceInput(std::string name, DType dtype, Shape example, bool label = false);
  // A layer reading `inputs`; returns its first output.
  ModelValue Layer(std::string name, std::vector<ModelValue> inputs, SingleOutputLayerFn define);
  // A layer with several outputs (Output(name, i) reads output i).
  void LayerWithOutputs(std::string name, std::vector<ModelValue> inputs, const LayerFn& define);
  // The loss: a layer whose single output is a scalar mean over the rows.
  void Loss(std::string name, std::vector<ModelValue> inputs, SingleOutputLayerFn define);
  // Output `output` of the layer named `layer`, declared before or after this call.
  static ModelValue LayerOutput(std::string layer, int output = 0);

  // Builds the model split over `ranks` ranks (tensor parallelism): what each rank runs, its
  // layers declaring their slices (LayerBuilder::SlicedParam) and partial sums. Call before
  // declaring layers.
  // With `shard_sequence`, Megatron-LM's sequence parallelism: layers may shard the sequence
  // (LayerBuilder::ScatterSum, GatherSequence, ShardSequence).
  void SplitOver(int ranks, bool shard_sequence = false) {
    tensor_parallel_ = ranks;
    shard_sequence_ = shard_sequence;
  }
  // Builds the model for `ranks` sequence ranks: what each runs on its 1/P of every sequence, its
  // layers marking the outputs exchanged by all-to-alls (LayerBuilder::Exchange), which trade
  // the sequence split for a head split (`attention` kUlysses) or rotate keys and values around
  // the ranks (kRing). Call before declaring layers.
  void SplitSequenceOver(int ranks, SequenceAttention attention = SequenceAttention::kUlysses) {
    sequence_parallel_ = ranks;
    sequence_attention_ = attention;
  }

  // Orders the layers, infers every shape, derives the backward of each layer.
  // InvalidArgument naming the layer (and op, and shapes) otherwise.
  Result<ModelSpec> Build() const;

 private:
  struct DeclaredLayer {
    std::string name;
    std::vector<ModelValue> inputs;
    LayerProgram program;
    std::vector<ParamInit> init;
    std::vector<std::pair<std::string, std::string>> shared;  // LayerBuilder::shared_
    std::vector<std::string> errors;
    bool loss = false;
    // Under SplitOver: per parameter its split, per output and input whether it is partial.
    std::vector<SlotSplit> splits;
    std::vector<bool> partial_outputs, partial_inputs;
    std::vector<ExchangeLayout> exchanged_outputs;          // Exchange's, per output
    std::vector<bool> scattered_outputs, gathered_outputs;  // per output
    bool sequence_sharded = false;
    bool hands_on_rotation = false;
  };
  // What Build works out about the layers before it writes their specs.
  struct Resolved {
    std::map<std::string, size_t> by_name;              // layer name -> index
    std::vector<std::vector<size_t>> producers;         // per layer, the layers it reads
    std::vector<LayerProgram> programs;                 // per layer, shared groups resolved
    std::vector<std::vector<size_t>> owners;            // per layer, its shared groups' owners
    std::vector<size_t> order;                          // layer indices, topologically
    std::vector<size_t> index_of;                       // layer index -> position in `order`
    std::vector<std::vector<TensorMeta>> output_metas;  // per layer, once its spec is made
  };

  // Build's steps, in order. Each returns InvalidArgument naming the model and the layer.
  // The layers by name: none with errors, no two of one name, exactly one loss layer.
  Result<std::map<std::string, size_t>> IndexLayers() const;
  // Per layer, the layers whose outputs it reads (declared ones, not the loss layer), and the
  // model inputs it reads exist.
  Result<std::vector<std::vector<size_t>>> ProducersOf(
      const std::map<std::string, size_t>& by_name) const;
  // The layer's program with its shared groups resolved against the owners' layouts, and the
  // owners' indices (one per group). InvalidArgument naming the layer and what is missing.
  Result<LayerProgram> ResolveShared(const DeclaredLayer& layer,
                                     const std::map<std::string, size_t>& by_name,
                                     std::vector<size_t>& owners) const;
  // Topological order of the layers (producers and shared groups' owners first), declaration
  // order among the ready, the loss layer last; InvalidArgument naming a cycle's layers.
  Result<std::vector<size_t>> Order(const std::vector<std::vector<size_t>>& producers) const;
  // The spec of the k-th layer in order; records its outputs' metas in `resolved`.
  Result<LayerSpec> SpecOf(size_t k, Resolved& resolved) const;
  // The layer's forward arguments for its declared inputs, their metas into `metas`, and the
  // inputs with gradients into `program`.
  Status AddInputArgs(const DeclaredLayer& declared, const Resolved& resolved, LayerSpec& layer,
                      LayerProgram& program, std::vector<TensorMeta>& metas) const;
  // The backward task's arguments and outputs; `first_shared`: the forward argument of the
  // first shared group.
  static void AddBackwardArgs(const DeclaredLayer& declared, const LayerProgram& program,
                              size_t first_shared, LayerSpec& layer);
  void Declare(std::string name, std::vector<ModelValue> inputs, const LayerFn& define, bool loss);

  std::string name_;
  const OpRegistry& registry_;
  int tensor_parallel_ = 1;
  bool shard_sequence_ = false;
  int sequence_parallel_ = 1;
  SequenceAttention sequence_attention_ = SequenceAttention::kUlysses;
  std::vector<ModelInput> inputs_;
  std::vector<DeclaredLayer> layers_;
};

}  // namespace tessera
