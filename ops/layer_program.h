// Layer programs: a layer's forward as a small graph of registered ops, run as one task, and its
// backward derived from the ops' gradient rules (OpDef::gradient), run as another.
//
// A program's values are numbered: first the layer's inputs (activations and model inputs),
// then its parameters (views of one flat f32 group, each at an offset), then the parameters it
// reads from other layers' groups (shared groups, in order; in each, its used slots in order),
// then every op's outputs in op order. The program travels inside the task as a string
// attribute ("program"), so a worker needs nothing but the registry to run it.
//
//   layer_forward   inputs:  the layer's inputs..., then the parameter group (if it has
//                            parameters; padded to a multiple of attribute param_multiple),
//                            then each shared group (the owner's whole group, padded alike)
//                   outputs: the program's outputs..., then `saved`: one flat f32 buffer with
//                            every value the backward reads that it does not get otherwise
//   layer_backward  inputs:  the gradient of each output (none for a loss program's output 0,
//                            whose gradient is attribute grad_scale, default 1), the layer's
//                            inputs, `saved`, then the parameter group, then each shared group
//                   outputs: the gradient of each of gradient_inputs, then of the parameter
//                            group (padding zero), then of each shared group: the owner's whole
//                            group, zero outside the slots this layer reads (the planner sums
//                            it with the owner's own part: planner/layer_expansion.cc)
//
// A task's attributes tensor_rank and sequence_rank (kTensorRankAttr, kSequenceRankAttr: a
// tensor-parallel layer's rank, a sequence-parallel plan's; set by the planner) are handed to
// every op of the program, forward and backward.
//
// The backward walks the ops in reverse. Each op with a gradient rule whose outputs have a
// gradient runs its backward op; the results are summed per value. Ops on values no gradient
// flows to (integer ids) are skipped; an op on the gradient's path with no rule is refused when
// the program is inferred, naming it.
//
// Keeping part (attribute "rebuild" = "cheap_ops" on layer_forward and the whole layer_backward,
// a partial keep the memory planner may choose: OpDef::rebuild_options): `saved` then holds only
// what the program's costly ops make (at least kCheapFlopsPerElement flops per element they
// make: convolutions, products) and what rebuilding the rest needs; the cheap ops' outputs
// (elementwise ops, norms, concatenation) are not saved when rebuilding them needs no more bytes
// than it saves. The backward runs a cheap op again when its walk first reads one of the op's
// outputs, and frees what it rebuilt once the walk is past its last reader, so the rebuilt
// values are not all live at once. Rebuilt values are the forward's bit for bit (the same
// kernels on the same inputs). The split backward halves refuse the attribute.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/attrs.h"
#include "core/status.h"
#include "core/tensor.h"
#include "ops/flat_layout.h"
#include "ops/op_registry.h"

namespace tessera {

inline constexpr const char* kProgramAttr = "program";

struct ProgramOp {
  std::string op;
  std::vector<int> inputs;  // values
  int outputs = 1;          // how many values it makes, numbered after every earlier value
  Attrs attrs;
  std::string label;  // for messages: "fc1" (the model API's name for the call), or empty
};

// Parameters of another layer's group that a program reads (a tied classifier reads the
// embedding's wte): the owner's whole layout, so that each slot's offset is known.
struct SharedGroup {
  std::string layer;       // the owner, for messages
  FlatLayout params;       // the owner's layout
  std::vector<int> slots;  // indices into params.slots(): the values, in order
};

struct LayerProgram {
  int inputs = 0;                   // the layer's inputs: values [0, inputs)
  FlatLayout params;                // values [inputs, inputs + params.slots().size())
  std::vector<SharedGroup> shared;  // their used slots: the values after the parameters
  std::vector<ProgramOp> ops;
  std::vector<int> outputs;  // values
  bool loss = false;         // outputs[0] is a scalar loss; the backward starts from it
  // The layer inputs (f32 or bf16 activations) whose gradients the backward returns, in order;
  // other inputs (model inputs, token ids) get none.
  std::vector<int> gradient_inputs;

  int num_values() const;
  int first_param() const { return inputs; }
  // The value number of shared group g's first used slot.
  int first_shared(size_t group) const;
  // Values before the first op's outputs: inputs, parameters and shared parameters.
  int num_leaf_values() const { return first_shared(shared.size()); }
  // The value number of op i's first output.
  int first_output(size_t op) const;

  std::string Encode() const;
  // InvalidArgument naming what is malformed.
  static Result<LayerProgram> Decode(std::string_view text);
};

// The value of attribute "rebuild" under which a program keeps part (above), and how many flops
// per element an op may make and still be rebuilt.
inline constexpr const char* kRebuildCheapOps = "cheap_ops";
inline constexpr double kCheapFlopsPerElement = 16;

// What the shapes of a program's inputs make of it.
struct ProgramShapes {
  std::vector<TensorMeta> values;  // every value's meta
  std::vector<bool> needs_gradient;
  // The values the backward reads that are not layer inputs or parameters (nor rebuilt), with
  // their byte offsets inside `saved` (each 64-byte aligned).
  std::vector<int> saved;
  std::vector<int64_t> saved_offset;
  int64_t saved_floats = 1;  // at least one element
  // Per op: whether the backward runs it again instead of reading its outputs from `saved`
  // (attribute "rebuild"; none without it).
  std::vector<bool> rebuilt;
};

// Infers every value of `program` given its layer inputs; `rebuild`: the attribute's value (empty:
// none; else kRebuildCheapOps). Errors name the op (its label) and the shapes it got; an unknown
// `rebuild` is InvalidArgument naming the values there are.
Result<ProgramShapes> InferProgram(const OpRegistry& registry, const LayerProgram& program,
                                   const std::vector<TensorMeta>& inputs,
                                   std::string_view rebuild = {});

// The forward work a backward repeats under `rebuild` (the rebuilt ops' cost).
Result<OpCost> ProgramRebuildCost(const OpRegistry& registry, const LayerProgram& program,
                                  const std::vector<TensorMeta>& inputs, std::string_view rebuild);

// Adds layer_forward and layer_backward (definitions; kernels: RegisterLayerProgramKernels).
Status RegisterLayerProgramOps(OpRegistry& registry);
// Their kernels for `device`: they run the program's ops with the registry's kernels for it.
// The copies between ops (program outputs, in-place inputs, gradient slices) are host memory
// operations, so only DeviceKind::kCpu works today.
Status RegisterLayerProgramKernels(OpRegistry& registry, DeviceKind device);

}  // namespace tessera
