// Model descriptions: what the planners take as input.
//
// A model is a DAG of layers over the model's inputs. Each layer has its parameters as one flat
// group (a FlatLayout naming the tensors inside it) and runs as two tasks per micro-batch: a
// forward task (one op) and a backward task (one op). A LayerSpec says which op each is and
// how their arguments are wired: the forward reads model inputs, activations (outputs of
// earlier layers, any earlier layer: skip connections are ordinary arguments) and parameter
// groups (its own, or another layer's: a tied classifier); the backward reads gradients of the
// forward's outputs, the forward's arguments and outputs, and returns gradients of the
// forward's activation and parameter arguments. Planners place these tasks and add the rest
// (gradient sums, reductions, gathers, the optimizer); they never look at parameter values or
// inside a layer.
//
// Layers come from two places: the model API (model/model.h: a layer is a small program of
// registered ops and its backward is derived from their gradient rules) or hand-fused layer
// ops with a hand-written backward (the transformer layer ops of ops/standard_ops.h, which
// model/gpt2.h wires by default: the fast path). How parameters start (ParamInit per slot), how
// they are named, and what identifies the model in a checkpoint are part of the description too,
// so a trainer needs nothing else. Nothing here knows any particular model.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/attrs.h"
#include "core/dtype.h"
#include "core/exchange_layout.h"
#include "core/status.h"
#include "core/tensor.h"
#include "ops/flat_layout.h"

namespace tessera {

// How a parameter tensor starts. Random values are drawn per slot from a stream of the trainer's
// seed (Trainer::InitializeParameters), so they depend on the seed, the layer's index and the
// slot's index only.
struct ParamInit {
  enum class Kind : uint8_t { kZeros, kOnes, kNormal, kUniform };
  Kind kind = Kind::kZeros;
  double scale = 0;  // kNormal: the standard deviation; kUniform: values in [-scale, scale)

  static ParamInit Zeros() { return {Kind::kZeros, 0}; }
  static ParamInit Ones() { return {Kind::kOnes, 0}; }
  static ParamInit Normal(double std) { return {Kind::kNormal, std}; }
  static ParamInit Uniform(double bound) { return {Kind::kUniform, bound}; }
};

// A tensor fed to the model each step, split over ranks and micro-batches along dimension 0.
struct ModelInput {
  std::string name;  // "tokens", "targets", "volume", "labels"
  DType dtype = DType::kF32;
  // Dimension 0 is the batch (its value here is only the example shapes were checked with).
  Shape shape;
  // Dimension 1 is the plan's seq_len (token inputs), at most shape[1].
  bool sequence = false;
  bool label = false;  // read by the loss only: not fed when predicting
  // In a model split into slabs (ModelSpec::split_into_slabs): the axis of which `shape` holds
  // one rank's part, sequence rank r feeding the r-th 1/P of each row's extent along it (a
  // volume's depth). -1: none (each rank reads whole rows, or a sequence input's 1/P of seq_len).
  int split_axis = -1;

  // Its tensor for `rows` rows (and a sequence input's seq_len), on `device`.
  TensorMeta Meta(int64_t rows, int64_t seq_len, Device device = Device::Cpu()) const;
};

// An argument of a layer's forward task, in the order its op takes them.
struct LayerArg {
  enum class Kind : uint8_t {
    kModelInput,  // index: into ModelSpec::inputs
    kActivation,  // index: an earlier layer; output: which of its activations
    kParams,      // index: the layer whose parameter group is read (this one, or a tied one)
  };
  Kind kind = Kind::kActivation;
  size_t index = 0;
  int output = 0;
};

// An argument of a layer's backward task, relative to its forward task.
struct BackwardArg {
  enum class Kind : uint8_t {
    kOutputGradient,  // index: a forward activation output; the loss's gradient w.r.t. it
    kForwardArg,      // index: a forward argument (re-gathered under ZeRO-3 if parameters)
    kForwardOutput,   // index: a forward output (what the forward kept for the backward)
    // index: a forward argument of kind kParams. The gradient of that group from the layers
    // whose backward ran before this one; the backward adds its part to it in place and
    // returns the sum (an embedding adds the part of the classifier tied to it).
    kGradientSoFar,
  };
  Kind kind = Kind::kOutputGradient;
  size_t index = 0;
};

// Tensor parallelism (Megatron-LM's tensor slicing). A model that can split over T ranks says
// how (ModelSpec::split_for_tensor_parallel): the split model is what each of the T ranks runs,
// the same layers on every rank, each over its slices of the parameters, and the planner adds the
// collectives the slicing needs (planner/tensor_parallel.h). A split model's parameters keep the
// whole model's names (ParamPrefix() + slot name); a parameter of the whole model may be split
// across several layers of the split model.
//
// How one slot of a split layer's group relates to the whole model's parameter of its name:
// dimension `dim` of the whole tensor is `blocks` equal blocks, each cut into T equal parts, and
// rank t holds part t of every block, in order (a fused QKV weight [3C, C] is three blocks: rank
// t holds its heads' rows of Q, of K and of V). dim -1: replicated, every rank holds all of it.
struct SlotSplit {
  int dim = -1;
  int64_t blocks = 1;
  bool replicated() const { return dim < 0; }
};

// What a layer of a split model adds to a LayerSpec.
struct TensorParallelLayer {
  std::vector<SlotSplit> slots;  // per slot of the layer's params
  // Per activation output: each rank's value is a partial sum; readers get the sum over the
  // ranks (an all-reduce after the forward; its backward passes the gradient on as it is).
  std::vector<bool> partial_outputs;
  // Per forward argument: the backward's gradient of this activation is a partial sum over the
  // ranks (all-reduced before it is used): what a column-parallel linear's input gets.
  std::vector<bool> partial_input_gradients;
  // Megatron-LM's sequence parallelism (ModelSpec::shards_sequence), per activation output
  // (empty: none):
  //   scattered  a partial sum reduce-scattered along the sequence instead of all-reduced: each
  //              rank reads its 1/T of the positions, [B, S/T, ...]; the gradient comes back
  //              all-gathered
  //   gathered   this rank's 1/T of the positions, read all-gathered along the sequence,
  //              [B, S, ...]; its readers' gradients, partial sums (each reader says so:
  //              partial_input_gradients), come back summed and scattered by a reduce-scatter
  //              in place of their all-reduces
  std::vector<bool> scattered_outputs;
  std::vector<bool> gathered_outputs;
  // The layer runs on this rank's 1/T of the positions: its replicated parameters' gradients
  // are partial sums over the ranks (all-reduced after its backward), and its ops get the rank
  // as attribute sequence_rank (the position embedding's offset).
  bool sequence_sharded = false;
  bool scatters(size_t output) const {
    return output < scattered_outputs.size() && scattered_outputs[output];
  }
  bool gathers(size_t output) const {
    return output < gathered_outputs.size() && gathered_outputs[output];
  }
};

struct LayerSpec {
  std::string name;  // "embedding", "h.0" ... "h.{L-1}", "head"
  FlatLayout params;
  std::string forward_op;
  std::string backward_op;
  Attrs attrs;  // given to both ops
  std::vector<LayerArg> forward_args;
  // The forward's first `activations` outputs are activations; the rest are kept for the
  // backward.
  int activations = 1;
  std::vector<BackwardArg> backward_args;
  // Per backward output: the forward argument (kActivation or kParams) it is the gradient of.
  std::vector<size_t> backward_outputs;
  // Optional, both or neither: the backward in two halves, for zero-bubble pipeline schedules
  // (the planner runs them instead of backward_op when its schedule splits backwards). Together
  // they compute what backward_op does.
  //   backward_input_op   reads the backward's arguments but the kGradientSoFar ones; returns
  //                       the gradients of the forward's activation arguments (in
  //                       backward_outputs' order), then a stash for the weight half
  //   backward_weight_op  reads the stash, then the backward's arguments but the
  //                       kOutputGradient ones; returns the gradients of the parameter
  //                       arguments (in backward_outputs' order)
  std::string backward_input_op, backward_weight_op;
  // Activation 0 is the model's loss: a scalar mean over the rows. The backward takes no
  // gradient of it; the planner sets attribute grad_scale (1/(ranks x micro-batches)), by
  // which the loss layer scales the gradients it starts.
  bool loss = false;
  // The loss layer only, optional: an op over the forward arguments minus label inputs that
  // returns the model's prediction (a language model's logits), for sampling.
  std::string predict_op;
  // Per slot of `params`: how it starts. Empty: every slot at zero.
  std::vector<ParamInit> init;
  // Parameters are named "<prefix><slot>" (Trainer::GetParameter, llm.c's tensor names); unset,
  // the prefix is the layer's name and a dot ("h.0.qkv_w", "enc0.conv1.w"). A model may name a
  // layer's parameters without it (GPT-2's "wte", "lnf_w", as nanoGPT does).
  std::optional<std::string> param_prefix;
  // In a split model (ModelSpec::tensor_parallel > 1): how the layer is split.
  std::optional<TensorParallelLayer> tensor_parallel;
  // In a sequence-parallel model (ModelSpec::sequence_parallel > 1), per activation output:
  // whether readers read it after an all-to-all over the sequence ranks, and in which layout
  // (core/exchange_layout.h: block j of each rank's value to rank j, joined into or
  // split from the sequence order; its gradient goes back by the adjoint all-to-all). Empty, or
  // kNone: read as it is.
  std::vector<ExchangeLayout> exchanged_outputs;
  bool exchanges(size_t output) const {
    return output < exchanged_outputs.size() && exchanged_outputs[output] != ExchangeLayout::kNone;
  }
  // Ring attention's hand-on layer (LayerBuilder::HandOnRotation): its one output is its forward
  // argument 0 (a block, or a block already rotated) rotated once more (kRingNext). The
  // planner follows such layers back to where a block started (RotationOrigin), and a backward
  // reading a rotated block re-derives it from there (planner/layer_expansion.cc) instead of
  // keeping the forward's copy.
  bool hands_on_rotation = false;

  std::string ParamPrefix() const { return param_prefix.value_or(name + "."); }
};

// How a sequence-parallel description attends over the whole sequence
// (ModelSpec::sequence_attention, ParallelConfig::sequence_attention):
enum class SequenceAttention : uint8_t {
  // DeepSpeed-Ulysses: all-to-alls trade the sequence split for a head split around attention.
  kUlysses,
  // Ring attention: each rank's keys and values rotated around the sequence ranks (P - 1
  // rotations, core/exchange_layout.h's kRingNext), each block attended by the rank's queries
  // and the partial results merged by their log-sum-exp.
  kRing,
  // Spatial parallelism (a volume's slabs along its depth, one a rank; no attention): each
  // convolution reads its neighbours' boundary planes (halos, core/exchange_layout.h's kHaloNext
  // and kHaloPrevious) and each norm the statistics of every slab (all-to-alls of kBlocks).
  kHalo,
};
// "ulysses", "ring", "halo"
const char* SequenceAttentionName(SequenceAttention attention);

struct ModelSpec {
  std::string name;  // "gpt2", "unet3d", or another model API's name
  std::vector<ModelInput> inputs;
  std::vector<LayerSpec> layers;  // in forward order: arguments name earlier layers only
  // What identifies the model in a checkpoint's manifest, which a trainer loading it compares:
  // its hyper-parameters (GPT-2: layers, channels, heads, vocab, max_seq_len). Empty: the name
  // and every layer's parameter count.
  Attrs config;
  // The ranks this description is split over (1: the whole model); see TensorParallelLayer.
  int tensor_parallel = 1;
  // Set by a model that can split: its description for T ranks (T >= 2). Empty: it cannot.
  std::function<Result<ModelSpec>(int ranks)> split_for_tensor_parallel;
  // Megatron-LM's sequence parallelism: a split for T ranks whose norms, residuals and other
  // replicated layers run on 1/T of each sequence (TensorParallelLayer::sequence_sharded), with
  // reduce-scatters and all-gathers along the sequence in place of the all-reduces; set on such
  // a split, and the function making it by a model that can.
  bool shards_sequence = false;
  std::function<Result<ModelSpec>(int ranks)> split_sharding_sequence;
  // Sequence parallelism (DeepSpeed-Ulysses): the ranks this description splits each sequence
  // over (1: none), and, set by a model that can, its description for P sequence ranks (P >= 2):
  // what each rank runs on its S/P positions of the same rows, the layers' parameters whole,
  // activations crossing between a sequence and a head split by all-to-alls
  // (LayerSpec::exchanged_outputs).
  int sequence_parallel = 1;
  std::function<Result<ModelSpec>(int ranks)> split_for_sequence_parallel;
  // Ring attention, the other way to split a sequence over P ranks: set on such a split
  // (kRing), and the function making it by a model that can. Its layers rotate keys and values
  // (LayerSpec::exchanged_outputs in kRingNext) instead of exchanging heads.
  SequenceAttention sequence_attention = SequenceAttention::kUlysses;
  std::function<Result<ModelSpec>(int ranks)> split_for_ring_attention;
  // Spatial parallelism (kHalo): set by a volume model that can, its description for P ranks,
  // each running on 1/P of every volume's depth (its inputs' ModelInput::split_axis).
  std::function<Result<ModelSpec>(int ranks)> split_into_slabs;

  // The description for `ranks` ranks: this one for 1, else split_for_tensor_parallel's
  // (split_sharding_sequence's when `shard_sequence`). InvalidArgument naming the model when it
  // cannot split, or not over that many ranks.
  Result<ModelSpec> SplitForTensorParallel(int ranks, bool shard_sequence = false) const;
  // The description for `ranks` sequence ranks: this one for 1, else
  // split_for_sequence_parallel's (split_for_ring_attention's for kRing, split_into_slabs' for
  // kHalo). InvalidArgument naming the model when it cannot.
  Result<ModelSpec> SplitForSequenceParallel(
      int ranks, SequenceAttention attention = SequenceAttention::kUlysses) const;
  // What a plan of T tensor and P sequence ranks runs (at most one of them above 1), the tensor
  // split sharding the sequence when `shard_sequence`, the sequence split attending by
  // `attention`.
  Result<ModelSpec> PlannedFor(int tensor_ranks, int sequence_ranks, bool shard_sequence = false,
                               SequenceAttention attention = SequenceAttention::kUlysses) const;
  // Whether this is a whole model's rewrite for tensor or sequence ranks.
  bool rewritten() const { return tensor_parallel > 1 || sequence_parallel > 1; }
  // The slabs each volume splits into (a split into slabs: kHalo), else 1.
  int slabs() const {
    return sequence_attention == SequenceAttention::kHalo ? sequence_parallel : 1;
  }
  // What one rank of a tensor-parallel split or of a split into slabs (this model) computes, as
  // a model of its own: the same layers, ops and shapes with the split's collectives left out
  // (each partial sum, halo and exchanged statistic read as it is), so one process can time a
  // rank's kernels (the plan search's calibration). Its values are not the split's: it is for
  // timing, not training. InvalidArgument for a split whose collectives change shapes
  // (Megatron-LM's sequence sharding, Ulysses' and ring attention's sequence parallelism): time
  // the tensor split without sequence sharding instead.
  Result<ModelSpec> OneRankView() const;
  int64_t NumParameters() const;
  // NotFound otherwise.
  Result<const LayerSpec*> FindLayer(std::string_view name) const;
  // The loss layer (the last one). InvalidArgument when the model has none.
  Result<size_t> LossLayer() const;
  // Ring attention: where forward argument `arg` of layer `l` comes from when it reads a block
  // rotated by hand-on layers (hands_on_rotation): the layer and output the first of them read
  // as it is (the rank's own block) and the rotations since (>= 1). Empty for anything else,
  // a block rotated by a layer that is not a hand-on one included (its readers' backwards read
  // the forward's copy).
  struct Rotated {
    size_t origin_layer = 0;
    int origin_output = 0;
    int rotations = 0;
  };
  std::optional<Rotated> RotationOrigin(size_t l, size_t arg) const;
  // Whether forward argument `arg` of `layer` reads an activation its producer all-gathers along
  // the sequence (TensorParallelLayer::gathered_outputs): its gradient is then summed by the
  // gather's adjoint reduce-scatter, not all-reduced. False for anything else, or out of range.
  bool ReadsGathered(const LayerSpec& layer, size_t arg) const;
  // InvalidArgument naming the layer and argument when the wiring is wrong: an argument naming
  // a later layer (a cycle) or one that does not exist, gradients of model inputs, no loss; or
  // when a layer's init does not give one ParamInit per slot; in a split model, a layer without
  // its TensorParallelLayer or with one of the wrong sizes.
  Status Validate() const;
};

}  // namespace tessera
