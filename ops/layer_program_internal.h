// What the layer program's sources share (internal to ops/): layer_program.cc holds the
// program (its encoding, shape inference and the split of its backward into halves),
// layer_program_ops.cc the definitions of layer_forward and layer_backward*, and
// layer_program_kernels.cc their kernels.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/attrs.h"
#include "core/status.h"
#include "core/tensor.h"
#include "ops/layer_program.h"
#include "ops/op_registry.h"

namespace tessera::detail {

using Metas = std::vector<TensorMeta>;

// "op 'name'", or "'label' (op 'name')" when the op has a label: for messages.
std::string OpLabel(const ProgramOp& op);

// The program in attribute kProgramAttr.
Result<LayerProgram> ProgramOf(const Attrs& attrs);
// Attribute "rebuild" (kRebuildAttr), empty when absent.
Result<std::string> RebuildOf(const Attrs& attrs);

inline bool HasParams(const LayerProgram& program) { return program.params.numel() > 0; }

// The seeded outputs take no gradient input: a loss program's output 0.
inline int GradientInputs(const LayerProgram& program) {
  return static_cast<int>(program.outputs.size()) - (program.loss ? 1 : 0);
}

// The split of a program's backward into its input and weight halves (layer_backward_input,
// layer_backward_weight), decided per op from the program's structure alone, so that both halves
// (and shape inference) agree on it. Per op with a gradient to compute:
//   kFull      its gradient rule runs in the input half; the parts it returns for parameters are
//              stashed and summed in the weight half
//   kSplit     the rule's input_op runs in the input half and its weight_op in the weight half,
//              from the output gradients, which are stashed (a linear: dx now, dW later)
//   kDeferred  every gradient it returns is a parameter's: the whole rule runs in the weight half
//              from the stashed output gradients (a layer's first convolution of the volume)
// Stash entries are in the order the backward visits the ops (last op first).
enum class Half : uint8_t { kNone, kFull, kSplit, kDeferred };
struct StashEntry {
  size_t op;
  bool param_part;  // a kFull op's gradient output `index`; else rule input `index` (an OutGrad)
  size_t index;
  TensorMeta meta;
  int64_t offset;  // bytes into the stash
};
struct SplitPlan {
  std::vector<Half> half;  // per op
  std::vector<StashEntry> stash;
  int64_t stash_floats = 1;
};

Result<SplitPlan> PlanSplit(const OpRegistry& registry, const LayerProgram& program,
                            const ProgramShapes& shapes);

// The backward's walk (its kernel's and the scratch replay's), per op: the op's gradient rule
// (Internal when it has none), and its stash entries, from the returned index to `next_entry`
// (moved past them: SplitPlan::stash is in the walk's order).
Result<const GradientRule*> BackwardRuleOf(const OpRegistry& registry, const ProgramOp& op);
size_t TakeStashEntries(const SplitPlan& plan, size_t op, size_t& next_entry);

// Which backward a kernel or inference is for: the whole one, or a half of the split one.
enum class BackwardPart : uint8_t { kAll, kInput, kWeight };

// Where each value of a forward is stored: its own place, or (donation) the place of the output
// of the in-place op that overwrites it, when that op is its last reader and nothing else keeps
// it (not kept for the backward, not an output of the layer, made by an earlier op, same size):
// the in-place op then finds its input already there instead of copying it (a classifier's
// logits become their gradient in place). Chains resolve to the last value's place.
Result<std::vector<int>> Donations(const OpRegistry& registry, const LayerProgram& program,
                                   const ProgramShapes& shapes);

// The values a backward rebuilds (ProgramShapes::rebuilt) and when: each made again, with its
// op's other outputs, when the walk first reads it, and dropped once the walk is past its last
// reader.
struct RebuildOrder {
  std::vector<int> producer;     // per value: its op when rebuilt, else -1
  std::vector<int> last_reader;  // per value: the lowest op reading it
  std::vector<size_t> rebuilt;   // the values rebuilt ops make
};
RebuildOrder PlanRebuild(const OpRegistry& registry, const LayerProgram& program,
                         const ProgramShapes& shapes);

// The most scratch the kernels of layer_forward and layer_backward* hold at once
// (OpDef::nested_workspace; `in`: the op's inputs): their allocations replayed on sizes alone
// (layer_program_workspace.cc): every value, gradient sum, zero and rebuilt value they take from
// KernelContext::allocator, each freed where the kernel drops it, and each nested op's own
// scratch while it runs.
Result<int64_t> ForwardWorkspace(const OpRegistry& registry, const Metas& in, const Attrs& attrs);
Result<int64_t> BackwardWorkspace(BackwardPart part, const OpRegistry& registry, const Metas& in,
                                  const Attrs& attrs);

}  // namespace tessera::detail
