// The definitions of layer_forward and layer_backward (whole, and its input and weight halves):
// shape inference over the program's inputs and parameter groups, and cost.
#include <algorithm>
#include <string>

#include <fmt/format.h>

#include "ops/layer_program.h"
#include "ops/layer_program_internal.h"
#include "ops/standard_ops.h"

namespace tessera {

namespace {

using detail::BackwardPart;
using detail::BackwardWorkspace;
using detail::ForwardWorkspace;
using detail::GradientInputs;
using detail::HasParams;
using detail::Metas;
using detail::PlanSplit;
using detail::ProgramOf;
using detail::RebuildOf;
using detail::SplitPlan;

// A parameter group of `layout`, padded to the attribute param_multiple.
Status CheckGroup(const FlatLayout& layout, const TensorMeta& group, const Attrs& attrs,
                  std::string_view what) {
  const int64_t multiple = std::max<int64_t>(1, attrs.GetInt(kParamMultipleAttr, 1));
  const int64_t want = PaddedNumel(layout.numel(), multiple);
  if (group.dtype != DType::kF32 || group.shape.rank() != 1 || group.numel() != want) {
    return InvalidArgument("{} is {} but needs f32 [{}]", what, group.ToString(), want);
  }
  return Status::Ok();
}

Status CheckParams(const LayerProgram& program, const TensorMeta& params, const Attrs& attrs) {
  return CheckGroup(program.params, params, attrs, "the layer's parameter group");
}

// The shared groups, the metas from `first` on.
Status CheckShared(const LayerProgram& program, const Metas& in, size_t first, const Attrs& attrs) {
  for (size_t g = 0; g < program.shared.size(); ++g) {
    TESSERA_RETURN_IF_ERROR(
        CheckGroup(program.shared[g].params, in[first + g], attrs,
                   fmt::format("the parameter group of '{}' (shared)", program.shared[g].layer)));
  }
  return Status::Ok();
}

// Groups after the layer inputs: its own (if it has parameters), then the shared ones.
size_t Groups(const LayerProgram& program) {
  return (HasParams(program) ? 1 : 0) + program.shared.size();
}

std::string GroupsText(const LayerProgram& program) {
  std::string text = HasParams(program) ? " and its parameter group" : "";
  if (!program.shared.empty()) {
    text += fmt::format(" and {} shared parameter group(s)", program.shared.size());
  }
  return text;
}

Result<Metas> InferForward(const OpRegistry& registry, const Metas& in, const Attrs& attrs) {
  TESSERA_ASSIGN_OR_RETURN(LayerProgram program, ProgramOf(attrs));
  const size_t layer_inputs = static_cast<size_t>(program.inputs);
  if (in.size() != layer_inputs + Groups(program)) {
    return InvalidArgument("the layer takes {} input(s){}, got {}", layer_inputs,
                           GroupsText(program), in.size());
  }
  if (HasParams(program)) TESSERA_RETURN_IF_ERROR(CheckParams(program, in[layer_inputs], attrs));
  TESSERA_RETURN_IF_ERROR(
      CheckShared(program, in, layer_inputs + (HasParams(program) ? 1 : 0), attrs));
  const Metas inputs(in.begin(), in.begin() + static_cast<long>(layer_inputs));
  TESSERA_ASSIGN_OR_RETURN(std::string rebuild, RebuildOf(attrs));
  TESSERA_ASSIGN_OR_RETURN(ProgramShapes shapes, InferProgram(registry, program, inputs, rebuild));
  Metas out;
  for (int v : program.outputs) out.push_back(shapes.values[static_cast<size_t>(v)]);
  const Device device = in.empty() ? Device::Cpu() : in[0].device;
  out.push_back(TensorMeta{Shape{shapes.saved_floats}, DType::kF32, device});
  return out;
}

// The inputs of a backward: `lead` tensors first (the output gradients; the weight half's
// stash), then the layer's inputs, `saved`, and the groups. Returns what the program makes of
// the layer's inputs, after checking the saved buffer and groups. The halves of a split
// backward (`part`) refuse attribute "rebuild".
Result<ProgramShapes> CheckBackwardInputs(BackwardPart part, const OpRegistry& registry,
                                          const LayerProgram& program, const Metas& in, size_t lead,
                                          const Attrs& attrs) {
  const size_t layer_inputs = static_cast<size_t>(program.inputs);
  const Metas inputs(in.begin() + static_cast<long>(lead),
                     in.begin() + static_cast<long>(lead + layer_inputs));
  TESSERA_ASSIGN_OR_RETURN(std::string rebuild, RebuildOf(attrs));
  if (!rebuild.empty() && part != BackwardPart::kAll) {
    return InvalidArgument(
        "the split layer backward (zero-bubble schedules) rebuilds nothing: drop attribute '{}' "
        "= '{}' or run the whole backward",
        kRebuildAttr, rebuild);
  }
  TESSERA_ASSIGN_OR_RETURN(ProgramShapes shapes, InferProgram(registry, program, inputs, rebuild));
  const TensorMeta& saved = in[lead + layer_inputs];
  if (saved.numel() != shapes.saved_floats) {
    return InvalidArgument("the saved buffer is {} but the layer keeps f32 [{}]", saved.ToString(),
                           shapes.saved_floats);
  }
  size_t group = lead + layer_inputs + 1;
  if (HasParams(program)) TESSERA_RETURN_IF_ERROR(CheckParams(program, in[group++], attrs));
  TESSERA_RETURN_IF_ERROR(CheckShared(program, in, group, attrs));
  return shapes;
}

Result<Metas> InferBackward(BackwardPart part, const OpRegistry& registry, const Metas& in,
                            const Attrs& attrs) {
  TESSERA_ASSIGN_OR_RETURN(LayerProgram program, ProgramOf(attrs));
  const size_t grads = static_cast<size_t>(GradientInputs(program));
  const size_t layer_inputs = static_cast<size_t>(program.inputs);
  const size_t lead = part == BackwardPart::kWeight ? 1 : grads;
  const size_t want = lead + layer_inputs + 1 + Groups(program);
  if (in.size() != want) {
    return InvalidArgument(
        "the layer's backward{} takes {}, {} input(s), the saved buffer{}: {} in all, got {}",
        part == BackwardPart::kWeight ? " (weight half)" : "",
        part == BackwardPart::kWeight ? std::string("the stash")
                                      : fmt::format("{} output gradient(s)", grads),
        layer_inputs, GroupsText(program), want, in.size());
  }
  TESSERA_ASSIGN_OR_RETURN(ProgramShapes shapes,
                           CheckBackwardInputs(part, registry, program, in, lead, attrs));
  Metas out;
  const size_t groups = lead + layer_inputs + 1;
  if (part == BackwardPart::kWeight) {
    TESSERA_ASSIGN_OR_RETURN(SplitPlan plan, PlanSplit(registry, program, shapes));
    if (in[0].dtype != DType::kF32 || in[0].numel() != plan.stash_floats) {
      return InvalidArgument("the stash is {} but the layer's input half makes f32 [{}]",
                             in[0].ToString(), plan.stash_floats);
    }
    for (size_t g = groups; g < in.size(); ++g) out.push_back(in[g]);
    return out;
  }
  for (size_t o = 0; o < grads; ++o) {
    const int value = program.outputs[o + (program.loss ? 1 : 0)];
    const TensorMeta& expected = shapes.values[static_cast<size_t>(value)];
    if (in[o].shape != expected.shape || in[o].dtype != expected.dtype) {
      return InvalidArgument("the gradient of output {} is {} but the output is {}", o,
                             in[o].ToString(), expected.ToString());
    }
  }
  for (int i : program.gradient_inputs) out.push_back(shapes.values[static_cast<size_t>(i)]);
  if (part == BackwardPart::kInput) {
    TESSERA_ASSIGN_OR_RETURN(SplitPlan plan, PlanSplit(registry, program, shapes));
    const Device device = in.empty() ? Device::Cpu() : in[0].device;
    out.push_back(TensorMeta{Shape{plan.stash_floats}, DType::kF32, device});
    return out;
  }
  for (size_t g = groups; g < in.size(); ++g) out.push_back(in[g]);
  return out;
}

Result<OpCost> ProgramCost(const OpRegistry& registry, const Metas& layer_inputs,
                           const Attrs& attrs, bool backward) {
  TESSERA_ASSIGN_OR_RETURN(LayerProgram program, ProgramOf(attrs));
  TESSERA_ASSIGN_OR_RETURN(ProgramShapes shapes, InferProgram(registry, program, layer_inputs));
  OpCost total;
  for (size_t i = 0; i < program.ops.size(); ++i) {
    const ProgramOp& op = program.ops[i];
    Metas metas;
    for (int v : op.inputs) metas.push_back(shapes.values[static_cast<size_t>(v)]);
    TESSERA_ASSIGN_OR_RETURN(OpCost cost, registry.Cost(op.op, metas, op.attrs));
    // A backward costs about twice its forward (two products per product).
    const double scale = backward ? 2.0 : 1.0;
    total.flops += scale * cost.flops;
    total.bytes += scale * cost.bytes;
  }
  return total;
}

// The forward work a backward repeats under the attributes' "rebuild" (none without it), given
// the layer's inputs (and, past them, anything: the groups).
Result<OpCost> ProgramRebuildCostOf(const OpRegistry& registry, const Metas& in,
                                    const Attrs& attrs) {
  TESSERA_ASSIGN_OR_RETURN(std::string rebuild, RebuildOf(attrs));
  if (rebuild.empty()) return OpCost{};
  TESSERA_ASSIGN_OR_RETURN(LayerProgram program, ProgramOf(attrs));
  if (in.size() < static_cast<size_t>(program.inputs)) {
    return InvalidArgument("too few inputs for the layer program's rebuild");
  }
  const Metas inputs(in.begin(), in.begin() + program.inputs);
  return ProgramRebuildCost(registry, program, inputs, rebuild);
}

}  // namespace

Status RegisterLayerProgramOps(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "layer_forward",
      .doc = "runs a layer program (attribute 'program'; ops/layer_program.h): its outputs and "
             "what its backward reads",
      .input_names = {"inputs"},
      .output_names = {"out"},
      .variadic_inputs = true,
      .variadic_outputs = true,
      .nested_infer = InferForward,
      .nested_cost = [](const OpRegistry& registry, const Metas& in,
                        const Attrs& attrs) -> Result<OpCost> {
        TESSERA_ASSIGN_OR_RETURN(LayerProgram program, ProgramOf(attrs));
        const Metas inputs(
            in.begin(), in.begin() + std::min<long>(program.inputs, static_cast<long>(in.size())));
        return ProgramCost(registry, inputs, attrs, /*backward=*/false);
      },
      .nested_workspace = ForwardWorkspace,
      .rebuild_options = {kRebuildCheapOps},
      .rebuild_cost = ProgramRebuildCostOf,
  }));
  struct Backward {
    const char* name;
    const char* doc;
    BackwardPart part;
  };
  for (const Backward& backward : {
           Backward{"layer_backward",
                    "the gradients of a layer program's inputs and parameters, derived from its "
                    "ops' gradient rules",
                    BackwardPart::kAll},
           Backward{"layer_backward_input",
                    "the input half of layer_backward (zero-bubble pipelines): the input "
                    "gradients, and a stash for the weight half",
                    BackwardPart::kInput},
           Backward{"layer_backward_weight",
                    "the weight half of layer_backward: the parameter gradients, from the input "
                    "half's stash",
                    BackwardPart::kWeight},
       }) {
    const BackwardPart part = backward.part;
    TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
        .name = backward.name,
        .doc = backward.doc,
        .input_names = {"inputs"},
        .output_names = {"grad"},
        .variadic_inputs = true,
        .variadic_outputs = true,
        .nested_infer =
            [part](const OpRegistry& registry, const Metas& in, const Attrs& attrs) {
              return InferBackward(part, registry, in, attrs);
            },
        .nested_cost = [part](const OpRegistry& registry, const Metas& in,
                              const Attrs& attrs) -> Result<OpCost> {
          TESSERA_ASSIGN_OR_RETURN(LayerProgram program, ProgramOf(attrs));
          const size_t lead =
              part == BackwardPart::kWeight ? 1 : static_cast<size_t>(GradientInputs(program));
          if (in.size() < lead + static_cast<size_t>(program.inputs)) {
            return InvalidArgument("too few inputs for the layer's backward");
          }
          const Metas inputs(in.begin() + static_cast<long>(lead),
                             in.begin() + static_cast<long>(lead) + program.inputs);
          // A backward costs about twice its forward (two products per product); each half
          // about once.
          TESSERA_ASSIGN_OR_RETURN(OpCost cost, ProgramCost(registry, inputs, attrs, true));
          if (part != BackwardPart::kAll) return OpCost{cost.flops / 2, cost.bytes / 2};
          // Plus the forward work it repeats when the forward kept part.
          TESSERA_ASSIGN_OR_RETURN(OpCost rebuild, ProgramRebuildCostOf(registry, inputs, attrs));
          return OpCost{cost.flops + rebuild.flops, cost.bytes + rebuild.bytes};
        },
        .nested_workspace =
            [part](const OpRegistry& registry, const Metas& in, const Attrs& attrs) {
              return BackwardWorkspace(part, registry, in, attrs);
            },
    }));
  }
  return Status::Ok();
}

}  // namespace tessera
