// The scratch of the layer program kernels (layer_program_kernels.cc), replayed on sizes alone:
// the same walk, allocating and dropping "buffers" that only count bytes. A buffer is freed when
// its last holder drops it, as a Tensor's is, so the replay holds what the kernel holds for as
// long as it holds it: values until the kernel returns (the forward), gradient sums until
// dropped, a rule's inputs and outputs until the op's turn of the walk ends, rebuilt values until
// the walk is past their last reader (the backward). memory_model_test checks the replay against
// what the kernels allocate, on real steps.
#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ops/layer_program.h"
#include "ops/layer_program_internal.h"

namespace tessera::detail {

namespace {

// Live and peak bytes of the buffers handed out.
class ScratchMeter {
 public:
  // A buffer of `bytes`: counted off when its last holder drops it.
  using Buffer = std::shared_ptr<const int64_t>;
  Buffer Allocate(int64_t bytes) {
    live_ += bytes;
    peak_ = std::max(peak_, live_);
    return Buffer(new int64_t(bytes), [this](const int64_t* held) {
      live_ -= *held;
      delete held;
    });
  }
  // A nested op's own scratch, on top of what is live while it runs.
  void During(int64_t scratch) { peak_ = std::max(peak_, live_ + scratch); }
  int64_t peak() const { return peak_; }

 private:
  int64_t live_ = 0, peak_ = 0;
};

// A value as the kernel sees it: undefined, a view of something it did not allocate (an input,
// a parameter, `saved`, an output), or a buffer of its own.
struct Held {
  bool defined = false;
  ScratchMeter::Buffer buffer;
};
Held View() { return Held{true, nullptr}; }

Metas MetasOf(const ProgramShapes& shapes, const std::vector<int>& values) {
  Metas metas;
  metas.reserve(values.size());
  for (int v : values) metas.push_back(shapes.values[static_cast<size_t>(v)]);
  return metas;
}

// Runs `op` on inputs of `metas` into fresh outputs (RunOp with no output given): its outputs
// allocated, and its scratch while it runs.
Result<std::vector<Held>> RunFresh(const OpRegistry& registry, ScratchMeter& meter,
                                   const std::string& op, const Metas& metas, const Attrs& attrs) {
  TESSERA_ASSIGN_OR_RETURN(Metas outputs, registry.InferShapes(op, metas, attrs));
  std::vector<Held> made;
  made.reserve(outputs.size());
  for (const TensorMeta& meta : outputs) made.push_back(Held{true, meter.Allocate(meta.bytes())});
  TESSERA_ASSIGN_OR_RETURN(int64_t scratch, registry.Workspace(op, metas, attrs));
  meter.During(scratch);
  return made;
}

}  // namespace

Result<int64_t> ForwardWorkspace(const OpRegistry& registry, const Metas& in, const Attrs& attrs) {
  TESSERA_ASSIGN_OR_RETURN(LayerProgram program, ProgramOf(attrs));
  if (in.size() < static_cast<size_t>(program.inputs)) {
    return InvalidArgument("too few inputs for the layer program");
  }
  TESSERA_ASSIGN_OR_RETURN(std::string rebuild, RebuildOf(attrs));
  TESSERA_ASSIGN_OR_RETURN(
      ProgramShapes shapes,
      InferProgram(registry, program, Metas(in.begin(), in.begin() + program.inputs), rebuild));
  ScratchMeter meter;
  std::vector<Held> values(static_cast<size_t>(program.num_values()));
  for (int v = 0; v < program.num_leaf_values(); ++v) values[static_cast<size_t>(v)] = View();
  for (int v : shapes.saved) values[static_cast<size_t>(v)] = View();
  for (int v : program.outputs) {
    if (v >= program.num_leaf_values()) values[static_cast<size_t>(v)] = View();  // made in place
  }
  TESSERA_ASSIGN_OR_RETURN(const std::vector<int> home, Donations(registry, program, shapes));
  for (size_t i = 0; i < program.ops.size(); ++i) {
    const ProgramOp& op = program.ops[i];
    const auto first = static_cast<size_t>(program.first_output(i));
    for (size_t v = first; v < first + static_cast<size_t>(op.outputs); ++v) {
      const auto root = static_cast<size_t>(home[v]);
      if (root == v || values[v].defined) continue;
      if (!values[root].defined) {
        values[root] = Held{true, meter.Allocate(shapes.values[root].bytes())};
      }
      values[v] = values[root];
    }
    for (size_t v = first; v < first + static_cast<size_t>(op.outputs); ++v) {
      if (!values[v].defined) values[v] = Held{true, meter.Allocate(shapes.values[v].bytes())};
    }
    TESSERA_ASSIGN_OR_RETURN(int64_t scratch,
                             registry.Workspace(op.op, MetasOf(shapes, op.inputs), op.attrs));
    meter.During(scratch);
  }
  return meter.peak();
}

Result<int64_t> BackwardWorkspace(BackwardPart part, const OpRegistry& registry, const Metas& in,
                                  const Attrs& attrs) {
  TESSERA_ASSIGN_OR_RETURN(LayerProgram program, ProgramOf(attrs));
  const size_t grads = static_cast<size_t>(GradientInputs(program));
  const size_t lead = part == BackwardPart::kWeight ? 1 : grads;
  if (in.size() < lead + static_cast<size_t>(program.inputs)) {
    return InvalidArgument("too few inputs for the layer's backward");
  }
  TESSERA_ASSIGN_OR_RETURN(std::string rebuild, RebuildOf(attrs));
  TESSERA_ASSIGN_OR_RETURN(
      ProgramShapes shapes,
      InferProgram(registry, program,
                   Metas(in.begin() + static_cast<long>(lead),
                         in.begin() + static_cast<long>(lead) + program.inputs),
                   rebuild));
  TESSERA_ASSIGN_OR_RETURN(SplitPlan plan, PlanSplit(registry, program, shapes));
  const RebuildOrder order = PlanRebuild(registry, program, shapes);
  ScratchMeter meter;
  std::vector<Held> values(static_cast<size_t>(program.num_values()));
  for (int v = 0; v < program.num_leaf_values(); ++v) values[static_cast<size_t>(v)] = View();
  for (int v : shapes.saved) values[static_cast<size_t>(v)] = View();

  // GradientSums: a sum starts as the first part added (owned or not) and is cloned before the
  // first addition into a part it does not own.
  std::vector<Held> sums(values.size());
  std::vector<bool> owned(values.size(), false);
  const auto add_sum = [&](int value, const Held& sum_part, bool part_owned) -> Status {
    const auto v = static_cast<size_t>(value);
    if (!sums[v].defined) {
      sums[v] = sum_part;
      owned[v] = part_owned;
      return Status::Ok();
    }
    if (!owned[v]) {
      sums[v] = Held{true, meter.Allocate(shapes.values[v].bytes())};
      owned[v] = true;
    }
    const TensorMeta& meta = shapes.values[v];
    TESSERA_ASSIGN_OR_RETURN(int64_t scratch, registry.Workspace("accumulate", {meta, meta}, {}));
    meter.During(scratch);
    return Status::Ok();
  };
  // The rebuilt values (Rebuilder::Make).
  std::function<Status(int)> make = [&](int value) -> Status {
    const auto v = static_cast<size_t>(value);
    if (values[v].defined || order.producer[v] < 0) return Status::Ok();
    const auto i = static_cast<size_t>(order.producer[v]);
    const ProgramOp& op = program.ops[i];
    for (int u : op.inputs) TESSERA_RETURN_IF_ERROR(make(u));
    TESSERA_ASSIGN_OR_RETURN(
        std::vector<Held> made,
        RunFresh(registry, meter, op.op, MetasOf(shapes, op.inputs), op.attrs));
    const auto first = static_cast<size_t>(program.first_output(i));
    for (size_t o = 0; o < made.size(); ++o) values[first + o] = std::move(made[o]);
    return Status::Ok();
  };

  if (part != BackwardPart::kWeight) {  // SeedGradients
    if (program.loss) {
      const auto loss = static_cast<size_t>(program.outputs[0]);
      TESSERA_RETURN_IF_ERROR(add_sum(program.outputs[0],
                                      Held{true, meter.Allocate(shapes.values[loss].bytes())},
                                      /*part_owned=*/true));
    }
    for (size_t o = 0; o < grads; ++o) {
      TESSERA_RETURN_IF_ERROR(
          add_sum(program.outputs[o + (program.loss ? 1 : 0)], View(), /*part_owned=*/false));
    }
  }

  size_t next_entry = 0;
  for (size_t i = program.ops.size(); i-- > 0;) {
    const Half half = plan.half[i];
    if (half == Half::kNone) continue;
    const ProgramOp& op = program.ops[i];
    const int first = program.first_output(i);
    TESSERA_ASSIGN_OR_RETURN(const GradientRule* rule_of, BackwardRuleOf(registry, op));
    const GradientRule& rule = *rule_of;
    const size_t entries = TakeStashEntries(plan, i, next_entry);
    const auto add = [&](const std::vector<Held>& outputs, size_t from) -> Status {
      for (size_t j = 0; j < outputs.size() && from + j < rule.gradient_of.size(); ++j) {
        const int value = op.inputs[static_cast<size_t>(rule.gradient_of[from + j])];
        if (!outputs[j].defined || !shapes.needs_gradient[static_cast<size_t>(value)]) continue;
        TESSERA_RETURN_IF_ERROR(add_sum(value, outputs[j], /*part_owned=*/true));
      }
      return Status::Ok();
    };
    if (part == BackwardPart::kWeight && half == Half::kFull) {
      for (size_t e = entries; e < next_entry; ++e) {
        const int value = op.inputs[static_cast<size_t>(rule.gradient_of[plan.stash[e].index])];
        TESSERA_RETURN_IF_ERROR(add_sum(value, View(), /*part_owned=*/false));
      }
      continue;
    }
    // Rebuilder::Provide.
    for (const GradientRule::Arg& arg : rule.inputs) {
      if (arg.from == GradientRule::From::kInput) {
        TESSERA_RETURN_IF_ERROR(make(op.inputs[static_cast<size_t>(arg.index)]));
      } else if (arg.from == GradientRule::From::kOutput) {
        TESSERA_RETURN_IF_ERROR(make(first + arg.index));
      }
    }
    // RuleInputs: held until this op's turn ends.
    std::vector<Held> inputs;
    Metas input_metas;
    for (const GradientRule::Arg& arg : rule.inputs) {
      const int value = arg.from == GradientRule::From::kInput
                            ? op.inputs[static_cast<size_t>(arg.index)]
                            : first + arg.index;
      const auto v = static_cast<size_t>(value);
      input_metas.push_back(shapes.values[v]);
      if (arg.from != GradientRule::From::kOutputGradient) {
        inputs.push_back(values[v]);
      } else if (part == BackwardPart::kWeight) {
        inputs.push_back(View());  // the stash
      } else if (sums[v].defined) {
        inputs.push_back(sums[v]);
      } else {
        inputs.push_back(Held{true, meter.Allocate(shapes.values[v].bytes())});  // zeros
      }
    }
    const auto drop_output_sums = [&] {
      const auto begin = static_cast<size_t>(first);
      for (size_t v = begin; v < begin + static_cast<size_t>(op.outputs); ++v) sums[v] = Held{};
    };
    if (part == BackwardPart::kWeight) {
      const bool split = half == Half::kSplit;
      TESSERA_ASSIGN_OR_RETURN(
          std::vector<Held> outputs,
          RunFresh(registry, meter, split ? rule.weight_op : rule.op, input_metas, op.attrs));
      TESSERA_RETURN_IF_ERROR(add(outputs, split ? static_cast<size_t>(rule.split_at) : 0));
      continue;
    }
    if (part == BackwardPart::kInput && half != Half::kFull) {
      drop_output_sums();
      if (half == Half::kDeferred) continue;
      TESSERA_ASSIGN_OR_RETURN(std::vector<Held> outputs,
                               RunFresh(registry, meter, rule.input_op, input_metas, op.attrs));
      TESSERA_RETURN_IF_ERROR(add(outputs, 0));
      continue;
    }
    TESSERA_ASSIGN_OR_RETURN(std::vector<Held> outputs,
                             RunFresh(registry, meter, rule.op, input_metas, op.attrs));
    drop_output_sums();
    if (part == BackwardPart::kInput) {
      for (size_t e = entries; e < next_entry; ++e) outputs[plan.stash[e].index] = Held{};
    }
    TESSERA_RETURN_IF_ERROR(add(outputs, 0));
    // Rebuilder::PassedOp.
    for (size_t v : order.rebuilt) {
      if (values[v].defined && order.last_reader[v] >= static_cast<int>(i)) values[v] = Held{};
    }
  }
  return meter.peak();
}

}  // namespace tessera::detail
