// The kernels of layer_forward and layer_backward*: they run the program's ops with the
// registry's kernels, summing gradients per value and stashing what the weight half needs.
//
// On the host or on a device: every value a kernel allocates, copies, zeroes or sets goes
// through Memory, which touches host tensors directly and device tensors only through the
// context's DeviceRuntime (its allocator, Copy and Zero), so the same code runs a program's ops on
// a GPU (RegisterLayerProgramKernels(registry, kCuda)). Checked on the simulated GPU, whose
// scrambled device memory turns a host access into wrong numbers.
#include <algorithm>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "ops/layer_program.h"
#include "ops/layer_program_internal.h"

namespace tessera {

namespace {

using detail::BackwardPart;
using detail::BackwardRuleOf;
using detail::Donations;
using detail::GradientInputs;
using detail::Half;
using detail::HasParams;
using detail::Metas;
using detail::OpLabel;
using detail::PlanRebuild;
using detail::PlanSplit;
using detail::ProgramOf;
using detail::RebuildOf;
using detail::RebuildOrder;
using detail::SplitPlan;
using detail::StashEntry;
using detail::TakeStashEntries;

using Tensors = std::vector<Tensor>;

// Memory operations on tensors wherever they live: host tensors directly, device tensors through
// the context's DeviceRuntime (stream-ordered there).
class Memory {
 public:
  explicit Memory(const KernelContext& context) : context_(context) {}

  Result<Tensor> Empty(const TensorMeta& meta) const {
    if (meta.device.is_cpu()) return Tensor::Empty(meta, context_.allocator);
    TESSERA_RETURN_IF_ERROR(NeedDevice(meta));
    return Tensor::Empty(meta, context_.device->allocator());
  }
  Result<Tensor> Zeros(const TensorMeta& meta) const {
    TESSERA_ASSIGN_OR_RETURN(Tensor zeros, Empty(meta));
    TESSERA_RETURN_IF_ERROR(Zero(zeros));
    return zeros;
  }
  Result<Tensor> Clone(const Tensor& t) const {
    TESSERA_ASSIGN_OR_RETURN(Tensor copy, Empty(t.meta()));
    TESSERA_RETURN_IF_ERROR(Copy(copy, t));
    return copy;
  }
  // dst = src (the same size; a no-op when they are the same bytes).
  Status Copy(const Tensor& dst, const Tensor& src) const {
    if (dst.raw_data() == src.raw_data() || src.bytes() == 0) return Status::Ok();
    if (dst.meta().device.is_cpu() && src.meta().device.is_cpu()) {
      std::memcpy(dst.raw_data(), src.raw_data(), static_cast<size_t>(src.bytes()));
      return Status::Ok();
    }
    TESSERA_RETURN_IF_ERROR(NeedDevice(dst.meta().device.is_cpu() ? src.meta() : dst.meta()));
    return context_.device->Copy(dst.raw_data(), dst.meta().device, src.raw_data(),
                                 src.meta().device, src.bytes());
  }
  Status Zero(const Tensor& t) const {
    if (t.meta().device.is_cpu()) {
      std::memset(t.raw_data(), 0, static_cast<size_t>(t.bytes()));
      return Status::Ok();
    }
    TESSERA_RETURN_IF_ERROR(NeedDevice(t.meta()));
    return context_.device->Zero(t.raw_data(), t.meta().device, t.bytes());
  }
  // An f32 scalar tensor set to `value`.
  Status Set(const Tensor& scalar, float value) const {
    if (scalar.meta().device.is_cpu()) {
      *scalar.data<float>() = value;
      return Status::Ok();
    }
    TESSERA_RETURN_IF_ERROR(NeedDevice(scalar.meta()));
    return context_.device->Copy(scalar.raw_data(), scalar.meta().device, &value, Device::Cpu(),
                                 sizeof(float));
  }

 private:
  Status NeedDevice(const TensorMeta& meta) const {
    if (context_.device == nullptr) {
      return Infeasible("a layer program holds a {} value in a process that opened no device",
                        meta.ToString());
    }
    return Status::Ok();
  }

  const KernelContext& context_;
};

// Runs `op` from the registry on `inputs` into `outputs` (allocated when undefined); in-place
// outputs start as a copy of their input.
Status RunOp(const KernelContext& context, DeviceKind device, const std::string& op,
             const Tensors& inputs, Tensors& outputs, const Attrs& attrs) {
  const OpRegistry& registry = *context.registry;
  Metas metas;
  for (const Tensor& t : inputs) metas.push_back(t.meta());
  TESSERA_ASSIGN_OR_RETURN(Metas out_metas, registry.InferShapes(op, metas, attrs));
  outputs.resize(out_metas.size());
  const Memory memory(context);
  for (size_t i = 0; i < out_metas.size(); ++i) {
    if (!outputs[i].defined()) {
      TESSERA_ASSIGN_OR_RETURN(outputs[i], memory.Empty(out_metas[i]));
    }
  }
  TESSERA_ASSIGN_OR_RETURN(const OpDef* def, registry.Find(op));
  for (const auto& [in, out] : def->in_place) {
    TESSERA_RETURN_IF_ERROR(
        memory.Copy(outputs[static_cast<size_t>(out)], inputs[static_cast<size_t>(in)]));
  }
  TESSERA_ASSIGN_OR_RETURN(const KernelFn* kernel, registry.FindKernel(op, device));
  return (*kernel)(context, inputs, outputs, attrs);
}

Tensor SavedView(const Tensor& saved, const ProgramShapes& shapes, size_t i) {
  return Tensor(shapes.values[static_cast<size_t>(shapes.saved[i])], saved.buffer(),
                saved.byte_offset() + shapes.saved_offset[i]);
}

Tensor ParamView(const Tensor& group, const FlatSlot& slot) {
  return Tensor(TensorMeta{slot.shape, DType::kF32, group.meta().device}, group.buffer(),
                group.byte_offset() + slot.offset * 4);
}

// Views of the parameter values: the layer's group, then the shared groups, in `in` from
// `first` on.
void BindParams(const LayerProgram& program, const Tensors& in, size_t first,
                std::vector<Tensor>& values) {
  size_t group = first;
  if (HasParams(program)) {
    for (size_t s = 0; s < program.params.slots().size(); ++s) {
      values[static_cast<size_t>(program.first_param()) + s] =
          ParamView(in[group], program.params.slots()[s]);
    }
    ++group;
  }
  for (size_t g = 0; g < program.shared.size(); ++g, ++group) {
    const SharedGroup& shared = program.shared[g];
    for (size_t i = 0; i < shared.slots.size(); ++i) {
      values[static_cast<size_t>(program.first_shared(g)) + i] =
          ParamView(in[group], shared.params.slots()[static_cast<size_t>(shared.slots[i])]);
    }
  }
}

Status CheckRegistry(const KernelContext& context) {
  if (context.registry == nullptr) {
    return Internal("a layer program ran without a registry in its kernel context");
  }
  return Status::Ok();
}

Status ForwardKernel(DeviceKind device, const KernelContext& context, const Tensors& in,
                     const Tensors& out, const Attrs& attrs) {
  TESSERA_RETURN_IF_ERROR(CheckRegistry(context));
  TESSERA_ASSIGN_OR_RETURN(LayerProgram program, ProgramOf(attrs));
  Metas input_metas;
  for (int i = 0; i < program.inputs; ++i) input_metas.push_back(in[static_cast<size_t>(i)].meta());
  TESSERA_ASSIGN_OR_RETURN(std::string rebuild, RebuildOf(attrs));
  TESSERA_ASSIGN_OR_RETURN(ProgramShapes shapes,
                           InferProgram(*context.registry, program, input_metas, rebuild));
  std::vector<Tensor> values(static_cast<size_t>(program.num_values()));
  for (int i = 0; i < program.inputs; ++i)
    values[static_cast<size_t>(i)] = in[static_cast<size_t>(i)];
  BindParams(program, in, static_cast<size_t>(program.inputs), values);
  // Values kept for the backward are made in their place in `saved`; the rest in scratch.
  const Tensor& saved = out.back();
  for (size_t i = 0; i < shapes.saved.size(); ++i) {
    values[static_cast<size_t>(shapes.saved[i])] = SavedView(saved, shapes, i);
  }
  // The layer's outputs that its ops make (and the backward does not keep) are made in place.
  for (size_t o = 0; o < program.outputs.size(); ++o) {
    Tensor& value = values[static_cast<size_t>(program.outputs[o])];
    if (program.outputs[o] >= program.num_leaf_values() && !value.defined()) value = out[o];
  }
  TESSERA_ASSIGN_OR_RETURN(const std::vector<int> home,
                           Donations(*context.registry, program, shapes));
  for (size_t i = 0; i < program.ops.size(); ++i) {
    const ProgramOp& op = program.ops[i];
    Tensors inputs;
    for (int v : op.inputs) inputs.push_back(values[static_cast<size_t>(v)]);
    const size_t first = static_cast<size_t>(program.first_output(i));
    // An output an in-place op will overwrite later is made where that op's output lives.
    for (int o = 0; o < op.outputs; ++o) {
      const int v = static_cast<int>(first) + o;
      const int root = home[static_cast<size_t>(v)];
      if (root == v || values[static_cast<size_t>(v)].defined()) continue;
      Tensor& storage = values[static_cast<size_t>(root)];
      if (!storage.defined()) {
        TESSERA_ASSIGN_OR_RETURN(storage,
                                 Memory(context).Empty(shapes.values[static_cast<size_t>(root)]));
      }
      values[static_cast<size_t>(v)] =
          Tensor(shapes.values[static_cast<size_t>(v)], storage.buffer(), storage.byte_offset());
    }
    Tensors outputs(values.begin() + static_cast<long>(first),
                    values.begin() + static_cast<long>(first) + op.outputs);
    Status ran = RunOp(context, device, op.op, inputs, outputs, op.attrs);
    if (!ran.ok()) return ran.WithContext(OpLabel(op));
    for (int o = 0; o < op.outputs; ++o)
      values[first + static_cast<size_t>(o)] = outputs[static_cast<size_t>(o)];
  }
  for (size_t o = 0; o < program.outputs.size(); ++o) {  // (a no-op for those made in place)
    TESSERA_RETURN_IF_ERROR(
        Memory(context).Copy(out[o], values[static_cast<size_t>(program.outputs[o])]));
  }
  return Status::Ok();
}

// Gradients being summed per value: a tensor this kernel may add into, once it owns one.
class GradientSums {
 public:
  GradientSums(const KernelContext& context, DeviceKind device, size_t values)
      : context_(context), device_(device), sums_(values), owned_(values, false) {}

  const Tensor& of(int value) const { return sums_[static_cast<size_t>(value)]; }
  // `part` is owned when nothing else reads it (a backward op's fresh output).
  Status Add(int value, const Tensor& part, bool owned) {
    Tensor& sum = sums_[static_cast<size_t>(value)];
    if (!sum.defined()) {
      sum = part;
      owned_[static_cast<size_t>(value)] = owned;
      return Status::Ok();
    }
    if (!owned_[static_cast<size_t>(value)]) {
      TESSERA_ASSIGN_OR_RETURN(sum, Memory(context_).Clone(sum));
      owned_[static_cast<size_t>(value)] = true;
    }
    Tensors outputs{sum};
    return RunOp(context_, device_, "accumulate", {sum, part}, outputs, {});
  }
  void Drop(int value) { sums_[static_cast<size_t>(value)] = Tensor(); }

 private:
  const KernelContext& context_;
  DeviceKind device_;
  std::vector<Tensor> sums_;
  std::vector<bool> owned_;
};

// Writes the gradients of `values` (sums per value; missing ones are zero) into `group`, laid
// out as `layout`, the rest (other slots, padding) zero.
Status WriteGroupGradient(const Memory& memory, const GradientSums& sums, const FlatLayout& layout,
                          const std::vector<int>& slots, int first_value, const Tensor& group) {
  TESSERA_RETURN_IF_ERROR(memory.Zero(group));
  for (size_t i = 0; i < slots.size(); ++i) {
    const Tensor& sum = sums.of(first_value + static_cast<int>(i));
    if (!sum.defined()) continue;
    TESSERA_RETURN_IF_ERROR(
        memory.Copy(ParamView(group, layout.slots()[static_cast<size_t>(slots[i])]), sum));
  }
  return Status::Ok();
}

// A stash entry's place in the stash.
Tensor Stashed(const Tensor& stash, const StashEntry& entry) {
  return Tensor(entry.meta, stash.buffer(), stash.byte_offset() + entry.offset);
}

// Starts the sums with the gradients a backward is given: attribute grad_scale for a loss
// program's output 0, and the first `grads` of `in` for the other outputs.
Status SeedGradients(const KernelContext& context, const LayerProgram& program,
                     const ProgramShapes& shapes, const Tensors& in, size_t grads,
                     const Attrs& attrs, GradientSums& sums) {
  if (program.loss) {
    const Memory memory(context);
    TESSERA_ASSIGN_OR_RETURN(Tensor seed,
                             memory.Empty(shapes.values[static_cast<size_t>(program.outputs[0])]));
    TESSERA_RETURN_IF_ERROR(
        memory.Set(seed, static_cast<float>(attrs.GetFloat("grad_scale", 1.0))));
    TESSERA_RETURN_IF_ERROR(sums.Add(program.outputs[0], seed, true));
  }
  for (size_t o = 0; o < grads; ++o) {
    TESSERA_RETURN_IF_ERROR(
        sums.Add(program.outputs[o + (program.loss ? 1 : 0)], in[o], /*owned=*/false));
  }
  return Status::Ok();
}

// The inputs of `op`'s gradient rule (the op's outputs are the values from `first` on): forward
// inputs and outputs from `values`; output gradients from the sums (zeros when none) or, in the
// weight half (`stash` set), from the stash, the op's entries from `entry` on.
Result<Tensors> RuleInputs(const KernelContext& context, const ProgramShapes& shapes,
                           const std::vector<Tensor>& values, const GradientSums& sums,
                           const ProgramOp& op, int first, const GradientRule& rule,
                           const Tensor* stash, const StashEntry* entry) {
  Tensors inputs;
  for (const GradientRule::Arg& arg : rule.inputs) {
    switch (arg.from) {
      case GradientRule::From::kOutputGradient: {
        const int value = first + arg.index;
        if (stash != nullptr) {
          inputs.push_back(Stashed(*stash, *entry++));
        } else if (sums.of(value).defined()) {
          inputs.push_back(sums.of(value));
        } else {
          TESSERA_ASSIGN_OR_RETURN(
              Tensor zeros, Memory(context).Zeros(shapes.values[static_cast<size_t>(value)]));
          inputs.push_back(std::move(zeros));
        }
        break;
      }
      case GradientRule::From::kInput:
        inputs.push_back(values[static_cast<size_t>(op.inputs[static_cast<size_t>(arg.index)])]);
        break;
      case GradientRule::From::kOutput:
        inputs.push_back(values[static_cast<size_t>(first) + static_cast<size_t>(arg.index)]);
        break;
    }
  }
  return inputs;
}

// Writes a backward's outputs from the sums: the gradients of the layer's gradient_inputs
// (unless `part` is the weight half), then (unless it is the input half) of its parameter group
// and of each shared group.
Status WriteGradients(const Memory& memory, BackwardPart part, const LayerProgram& program,
                      const GradientSums& sums, const Tensors& out) {
  size_t next = 0;
  if (part != BackwardPart::kWeight) {
    for (int i : program.gradient_inputs) {
      const Tensor& target = out[next++];
      const Tensor& sum = sums.of(i);
      TESSERA_RETURN_IF_ERROR(sum.defined() ? memory.Copy(target, sum) : memory.Zero(target));
    }
  }
  if (part == BackwardPart::kInput) return Status::Ok();
  if (HasParams(program)) {
    std::vector<int> every(program.params.slots().size());
    for (size_t s = 0; s < every.size(); ++s) every[s] = static_cast<int>(s);
    TESSERA_RETURN_IF_ERROR(WriteGroupGradient(memory, sums, program.params, every,
                                               program.first_param(), out[next++]));
  }
  for (size_t g = 0; g < program.shared.size(); ++g) {
    const SharedGroup& shared = program.shared[g];
    TESSERA_RETURN_IF_ERROR(WriteGroupGradient(memory, sums, shared.params, shared.slots,
                                               program.first_shared(g), out[next++]));
  }
  return Status::Ok();
}

// The values a backward rebuilds (ProgramShapes::rebuilt): each made again, with its op's other
// outputs, when the walk first reads it, and dropped once the walk is past its last reader.
class Rebuilder {
 public:
  Rebuilder(const KernelContext& context, DeviceKind device, const LayerProgram& program,
            const ProgramShapes& shapes, std::vector<Tensor>& values)
      : context_(context),
        device_(device),
        program_(program),
        values_(values),
        order_(PlanRebuild(*context.registry, program, shapes)) {}

  // Makes every value `op`'s rule reads that is rebuilt and not live.
  Status Provide(const ProgramOp& op, int first, const GradientRule& rule) {
    for (const GradientRule::Arg& arg : rule.inputs) {
      if (arg.from == GradientRule::From::kInput) {
        TESSERA_RETURN_IF_ERROR(Make(op.inputs[static_cast<size_t>(arg.index)]));
      } else if (arg.from == GradientRule::From::kOutput) {
        TESSERA_RETURN_IF_ERROR(Make(first + arg.index));
      }
    }
    return Status::Ok();
  }

  // Drops the rebuilt values no op before `op` reads.
  void PassedOp(size_t op) {
    for (size_t v : order_.rebuilt) {
      if (values_[v].defined() && order_.last_reader[v] >= static_cast<int>(op)) {
        values_[v] = Tensor();
      }
    }
  }

 private:
  Status Make(int value) {
    const auto v = static_cast<size_t>(value);
    if (values_[v].defined() || order_.producer[v] < 0) return Status::Ok();
    const auto i = static_cast<size_t>(order_.producer[v]);
    const ProgramOp& op = program_.ops[i];
    Tensors inputs;
    for (int u : op.inputs) {
      TESSERA_RETURN_IF_ERROR(Make(u));
      inputs.push_back(values_[static_cast<size_t>(u)]);
    }
    Tensors outputs;
    Status ran = RunOp(context_, device_, op.op, inputs, outputs, op.attrs);
    if (!ran.ok()) return ran.WithContext(fmt::format("rebuilding {}", OpLabel(op)));
    const auto first = static_cast<size_t>(program_.first_output(i));
    for (size_t o = 0; o < outputs.size(); ++o) values_[first + o] = std::move(outputs[o]);
    return Status::Ok();
  }

  const KernelContext& context_;
  DeviceKind device_;
  const LayerProgram& program_;
  std::vector<Tensor>& values_;
  RebuildOrder order_;
};

// The backward (BackwardPart::kAll) or one half of it; see PlanSplit for what each half does per
// op.
Status BackwardKernel(BackwardPart part, DeviceKind device, const KernelContext& context,
                      const Tensors& in, const Tensors& out, const Attrs& attrs) {
  TESSERA_RETURN_IF_ERROR(CheckRegistry(context));
  const OpRegistry& registry = *context.registry;
  TESSERA_ASSIGN_OR_RETURN(LayerProgram program, ProgramOf(attrs));
  const size_t grads = static_cast<size_t>(GradientInputs(program));
  const size_t layer_inputs = static_cast<size_t>(program.inputs);
  const size_t lead = part == BackwardPart::kWeight ? 1 : grads;
  Metas input_metas;
  for (size_t i = 0; i < layer_inputs; ++i) input_metas.push_back(in[lead + i].meta());
  // Inference (CheckBackwardInputs) has refused "rebuild" on the split halves.
  TESSERA_ASSIGN_OR_RETURN(std::string rebuild, RebuildOf(attrs));
  TESSERA_ASSIGN_OR_RETURN(ProgramShapes shapes,
                           InferProgram(registry, program, input_metas, rebuild));
  TESSERA_ASSIGN_OR_RETURN(SplitPlan plan, PlanSplit(registry, program, shapes));
  std::vector<Tensor> values(static_cast<size_t>(program.num_values()));
  for (size_t i = 0; i < layer_inputs; ++i) values[i] = in[lead + i];
  const Tensor& saved = in[lead + layer_inputs];
  for (size_t i = 0; i < shapes.saved.size(); ++i) {
    values[static_cast<size_t>(shapes.saved[i])] = SavedView(saved, shapes, i);
  }
  BindParams(program, in, lead + layer_inputs + 1, values);
  const Tensor stash = part == BackwardPart::kInput
                           ? out.back()
                           : (part == BackwardPart::kWeight ? in[0] : Tensor());
  const auto stashed = [&stash](const StashEntry& entry) { return Stashed(stash, entry); };
  const Memory memory(context);
  const auto keep = [&stashed, &memory](const StashEntry& entry, const Tensor& value) {
    return memory.Copy(stashed(entry), value);
  };

  Rebuilder rebuilder(context, device, program, shapes, values);
  GradientSums sums(context, device, values.size());
  if (part != BackwardPart::kWeight) {
    TESSERA_RETURN_IF_ERROR(SeedGradients(context, program, shapes, in, grads, attrs, sums));
  }

  size_t next_entry = 0;  // plan.stash is in the order of this loop
  for (size_t i = program.ops.size(); i-- > 0;) {
    const Half half = plan.half[i];
    if (half == Half::kNone) continue;
    const ProgramOp& op = program.ops[i];
    const int first = program.first_output(i);
    TESSERA_ASSIGN_OR_RETURN(const GradientRule* rule_of, BackwardRuleOf(registry, op));
    const GradientRule& rule = *rule_of;
    const size_t entries = TakeStashEntries(plan, i, next_entry);
    // The gradient of forward input gradient_of[from + j] (unless taken: undefined) goes into
    // the sums.
    const auto add = [&](const Tensors& outputs, size_t from) -> Status {
      for (size_t j = 0; j < outputs.size() && from + j < rule.gradient_of.size(); ++j) {
        const int value = op.inputs[static_cast<size_t>(rule.gradient_of[from + j])];
        if (!outputs[j].defined() || !shapes.needs_gradient[static_cast<size_t>(value)]) continue;
        TESSERA_RETURN_IF_ERROR(sums.Add(value, outputs[j], /*owned=*/true));
      }
      return Status::Ok();
    };
    const auto run = [&](const std::string& name, const Tensors& inputs,
                         Tensors& outputs) -> Status {
      Status ran = RunOp(context, device, name, inputs, outputs, op.attrs);
      return ran.ok() ? ran : ran.WithContext(fmt::format("the backward of {}", OpLabel(op)));
    };

    if (part == BackwardPart::kWeight && half == Half::kFull) {
      // The parameter parts the input half computed.
      for (size_t e = entries; e < next_entry; ++e) {
        const int value = op.inputs[static_cast<size_t>(rule.gradient_of[plan.stash[e].index])];
        TESSERA_RETURN_IF_ERROR(sums.Add(value, stashed(plan.stash[e]), /*owned=*/false));
      }
      continue;
    }
    TESSERA_RETURN_IF_ERROR(rebuilder.Provide(op, first, rule));
    TESSERA_ASSIGN_OR_RETURN(
        Tensors inputs,
        RuleInputs(context, shapes, values, sums, op, first, rule,
                   part == BackwardPart::kWeight ? &stash : nullptr, plan.stash.data() + entries));

    if (part == BackwardPart::kWeight) {
      const bool split = half == Half::kSplit;
      Tensors outputs;
      TESSERA_RETURN_IF_ERROR(run(split ? rule.weight_op : rule.op, inputs, outputs));
      TESSERA_RETURN_IF_ERROR(add(outputs, split ? static_cast<size_t>(rule.split_at) : 0));
      continue;
    }

    if (part == BackwardPart::kInput && half != Half::kFull) {
      // The output gradients wait in the stash for the weight half.
      size_t entry = entries;
      for (size_t a = 0; a < rule.inputs.size(); ++a) {
        if (rule.inputs[a].from == GradientRule::From::kOutputGradient) {
          TESSERA_RETURN_IF_ERROR(keep(plan.stash[entry++], inputs[a]));
        }
      }
      for (int o = 0; o < op.outputs; ++o) sums.Drop(first + o);
      if (half == Half::kDeferred) continue;
      Tensors outputs;
      TESSERA_RETURN_IF_ERROR(run(rule.input_op, inputs, outputs));
      TESSERA_RETURN_IF_ERROR(add(outputs, 0));
      continue;
    }

    Tensors outputs;
    TESSERA_RETURN_IF_ERROR(run(rule.op, inputs, outputs));
    for (int o = 0; o < op.outputs; ++o) sums.Drop(first + o);
    if (part == BackwardPart::kInput) {  // the parameter parts go to the stash, the rest on
      for (size_t e = entries; e < next_entry; ++e) {
        TESSERA_RETURN_IF_ERROR(keep(plan.stash[e], outputs[plan.stash[e].index]));
        outputs[plan.stash[e].index] = Tensor();
      }
    }
    TESSERA_RETURN_IF_ERROR(add(outputs, 0));
    rebuilder.PassedOp(i);
  }

  return WriteGradients(memory, part, program, sums, out);
}

}  // namespace

Status RegisterLayerProgramKernels(OpRegistry& r, DeviceKind device) {
  TESSERA_RETURN_IF_ERROR(r.AddKernel(
      "layer_forward", device,
      [device](const KernelContext& context, const Tensors& in, const Tensors& out,
               const Attrs& attrs) { return ForwardKernel(device, context, in, out, attrs); }));
  for (const auto& [name, part] : {std::pair{"layer_backward", BackwardPart::kAll},
                                   std::pair{"layer_backward_input", BackwardPart::kInput},
                                   std::pair{"layer_backward_weight", BackwardPart::kWeight}}) {
    TESSERA_RETURN_IF_ERROR(
        r.AddKernel(name, device,
                    // `part = part`: Clang 15 cannot capture a structured binding itself.
                    [device, part = part](const KernelContext& context, const Tensors& in,
                                          const Tensors& out, const Attrs& attrs) {
                      return BackwardKernel(part, device, context, in, out, attrs);
                    }));
  }
  return Status::Ok();
}

}  // namespace tessera
