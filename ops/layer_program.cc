#include "ops/layer_program.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <map>
#include <type_traits>

#include <fmt/format.h>

#include "ops/standard_ops.h"

namespace tessera {

int LayerProgram::num_values() const {
  int values = num_leaf_values();
  for (const ProgramOp& op : ops) values += op.outputs;
  return values;
}

int LayerProgram::first_shared(size_t group) const {
  int value = inputs + static_cast<int>(params.slots().size());
  for (size_t g = 0; g < group; ++g) value += static_cast<int>(shared[g].slots.size());
  return value;
}

int LayerProgram::first_output(size_t op) const {
  int value = num_leaf_values();
  for (size_t i = 0; i < op; ++i) value += ops[i].outputs;
  return value;
}

// ---- Encoding: space-separated tokens; strings as <length>:<bytes> ----

namespace {

void PutString(std::string& out, std::string_view text) {
  out += fmt::format("{}:{} ", text.size(), text);
}
void PutInt(std::string& out, int64_t value) { out += fmt::format("{} ", value); }

class Reader {
 public:
  explicit Reader(std::string_view text) : text_(text) {}

  Result<int64_t> Int() {
    SkipSpaces();
    int64_t value = 0;
    auto [end, error] = std::from_chars(text_.data() + pos_, text_.data() + text_.size(), value);
    if (error != std::errc()) return Malformed("a number");
    pos_ = static_cast<size_t>(end - text_.data());
    return value;
  }
  Result<double> Float() {
    SkipSpaces();
    const std::string token(Token());
    char* end = nullptr;
    const double value = std::strtod(token.c_str(), &end);
    if (token.empty() || end != token.c_str() + token.size()) return Malformed("a number");
    return value;
  }
  Result<std::string> String() {
    TESSERA_ASSIGN_OR_RETURN(int64_t length, Int());
    if (length < 0 || pos_ >= text_.size() || text_[pos_] != ':' ||
        static_cast<size_t>(length) > text_.size() - pos_ - 1) {
      return Malformed("a string");
    }
    std::string value(text_.substr(pos_ + 1, static_cast<size_t>(length)));
    pos_ += 1 + static_cast<size_t>(length);
    return value;
  }
  Result<std::string> Word() {
    SkipSpaces();
    std::string word(Token());
    if (word.empty()) return Malformed("a word");
    return word;
  }
  Status Expect(std::string_view word) {
    TESSERA_ASSIGN_OR_RETURN(std::string got, Word());
    if (got != word) return Malformed(fmt::format("'{}'", word));
    return Status::Ok();
  }
  // A count in [0, limit].
  Result<int64_t> Count(int64_t limit) {
    TESSERA_ASSIGN_OR_RETURN(int64_t count, Int());
    if (count < 0 || count > limit) return Malformed(fmt::format("a count up to {}", limit));
    return count;
  }
  bool AtEnd() {
    SkipSpaces();
    return pos_ == text_.size();
  }

 private:
  void SkipSpaces() {
    while (pos_ < text_.size() && text_[pos_] == ' ') ++pos_;
  }
  std::string_view Token() {
    const size_t start = pos_;
    while (pos_ < text_.size() && text_[pos_] != ' ') ++pos_;
    return text_.substr(start, pos_ - start);
  }
  Status Malformed(std::string_view what) const {
    return InvalidArgument("malformed layer program: expected {} at character {}", what, pos_);
  }

  std::string_view text_;
  size_t pos_ = 0;
};

constexpr int64_t kMaxItems = 1 << 20;

void PutLayout(std::string& out, const FlatLayout& layout) {
  PutInt(out, static_cast<int64_t>(layout.slots().size()));
  for (const FlatSlot& slot : layout.slots()) {
    PutString(out, slot.name);
    PutInt(out, slot.weight_decay ? 1 : 0);
    PutInt(out, slot.shape.rank());
    for (int64_t d : slot.shape.dims()) PutInt(out, d);
  }
}

Result<FlatLayout> ReadLayout(Reader& in) {
  FlatLayout layout;
  TESSERA_ASSIGN_OR_RETURN(int64_t slots, in.Count(kMaxItems));
  for (int64_t i = 0; i < slots; ++i) {
    TESSERA_ASSIGN_OR_RETURN(std::string name, in.String());
    TESSERA_ASSIGN_OR_RETURN(int64_t decay, in.Count(1));
    TESSERA_ASSIGN_OR_RETURN(int64_t rank, in.Count(8));
    std::vector<int64_t> dims;
    for (int64_t d = 0; d < rank; ++d) {
      TESSERA_ASSIGN_OR_RETURN(int64_t dim, in.Count(int64_t{1} << 40));
      dims.push_back(dim);
    }
    layout.Add(std::move(name), Shape(std::move(dims)), decay == 1);
  }
  return layout;
}

}  // namespace

// Version 2 added the shared groups ("S"); version 1 text is refused rather than misread.
std::string LayerProgram::Encode() const {
  std::string out = "LP2 ";
  PutInt(out, inputs);
  PutInt(out, loss ? 1 : 0);
  out += "G ";
  PutInt(out, static_cast<int64_t>(gradient_inputs.size()));
  for (int i : gradient_inputs) PutInt(out, i);
  out += "P ";
  PutLayout(out, params);
  out += "S ";
  PutInt(out, static_cast<int64_t>(shared.size()));
  for (const SharedGroup& group : shared) {
    PutString(out, group.layer);
    PutLayout(out, group.params);
    PutInt(out, static_cast<int64_t>(group.slots.size()));
    for (int slot : group.slots) PutInt(out, slot);
  }
  out += "O ";
  PutInt(out, static_cast<int64_t>(ops.size()));
  for (const ProgramOp& op : ops) {
    PutString(out, op.op);
    PutString(out, op.label);
    PutInt(out, static_cast<int64_t>(op.inputs.size()));
    for (int v : op.inputs) PutInt(out, v);
    PutInt(out, op.outputs);
    PutInt(out, static_cast<int64_t>(op.attrs.values().size()));
    for (const auto& [name, value] : op.attrs.values()) {
      PutString(out, name);
      std::visit(
          [&](const auto& v) {
            using T = std::decay_t<decltype(v)>;
            if constexpr (std::is_same_v<T, int64_t>) {
              out += "i ";
              PutInt(out, v);
            } else if constexpr (std::is_same_v<T, double>) {
              out += fmt::format("f {:.17g} ", v);
            } else if constexpr (std::is_same_v<T, std::string>) {
              out += "s ";
              PutString(out, v);
            } else {
              out += "v ";
              PutInt(out, static_cast<int64_t>(v.size()));
              for (int64_t x : v) PutInt(out, x);
            }
          },
          value);
    }
  }
  out += "R ";
  PutInt(out, static_cast<int64_t>(outputs.size()));
  for (int v : outputs) PutInt(out, v);
  return out;
}

Result<LayerProgram> LayerProgram::Decode(std::string_view text) {
  Reader in(text);
  LayerProgram program;
  TESSERA_RETURN_IF_ERROR(in.Expect("LP2"));
  TESSERA_ASSIGN_OR_RETURN(int64_t inputs, in.Count(kMaxItems));
  program.inputs = static_cast<int>(inputs);
  TESSERA_ASSIGN_OR_RETURN(int64_t loss, in.Count(1));
  program.loss = loss == 1;
  TESSERA_RETURN_IF_ERROR(in.Expect("G"));
  TESSERA_ASSIGN_OR_RETURN(int64_t gradient_inputs, in.Count(inputs));
  for (int64_t i = 0; i < gradient_inputs; ++i) {
    TESSERA_ASSIGN_OR_RETURN(int64_t input, in.Count(inputs - 1));
    program.gradient_inputs.push_back(static_cast<int>(input));
  }
  TESSERA_RETURN_IF_ERROR(in.Expect("P"));
  TESSERA_ASSIGN_OR_RETURN(program.params, ReadLayout(in));
  TESSERA_RETURN_IF_ERROR(in.Expect("S"));
  TESSERA_ASSIGN_OR_RETURN(int64_t groups, in.Count(kMaxItems));
  for (int64_t g = 0; g < groups; ++g) {
    SharedGroup group;
    TESSERA_ASSIGN_OR_RETURN(group.layer, in.String());
    TESSERA_ASSIGN_OR_RETURN(group.params, ReadLayout(in));
    const int64_t slots = static_cast<int64_t>(group.params.slots().size());
    TESSERA_ASSIGN_OR_RETURN(int64_t used, in.Count(slots));
    for (int64_t i = 0; i < used; ++i) {
      TESSERA_ASSIGN_OR_RETURN(int64_t slot, in.Count(slots - 1));
      group.slots.push_back(static_cast<int>(slot));
    }
    program.shared.push_back(std::move(group));
  }
  TESSERA_RETURN_IF_ERROR(in.Expect("O"));
  TESSERA_ASSIGN_OR_RETURN(int64_t ops, in.Count(kMaxItems));
  int values = program.num_leaf_values();
  for (int64_t i = 0; i < ops; ++i) {
    ProgramOp op;
    TESSERA_ASSIGN_OR_RETURN(op.op, in.String());
    TESSERA_ASSIGN_OR_RETURN(op.label, in.String());
    TESSERA_ASSIGN_OR_RETURN(int64_t arity, in.Count(kMaxItems));
    for (int64_t a = 0; a < arity; ++a) {
      TESSERA_ASSIGN_OR_RETURN(int64_t value, in.Count(values - 1));
      op.inputs.push_back(static_cast<int>(value));
    }
    TESSERA_ASSIGN_OR_RETURN(int64_t outputs, in.Count(kMaxItems));
    op.outputs = static_cast<int>(outputs);
    values += op.outputs;
    TESSERA_ASSIGN_OR_RETURN(int64_t attrs, in.Count(kMaxItems));
    for (int64_t a = 0; a < attrs; ++a) {
      TESSERA_ASSIGN_OR_RETURN(std::string name, in.String());
      TESSERA_ASSIGN_OR_RETURN(std::string type, in.Word());
      if (type == "i") {
        TESSERA_ASSIGN_OR_RETURN(int64_t v, in.Int());
        op.attrs.Set(name, v);
      } else if (type == "f") {
        TESSERA_ASSIGN_OR_RETURN(double v, in.Float());
        op.attrs.Set(name, v);
      } else if (type == "s") {
        TESSERA_ASSIGN_OR_RETURN(std::string v, in.String());
        op.attrs.Set(name, std::move(v));
      } else if (type == "v") {
        TESSERA_ASSIGN_OR_RETURN(int64_t n, in.Count(kMaxItems));
        std::vector<int64_t> v;
        for (int64_t x = 0; x < n; ++x) {
          TESSERA_ASSIGN_OR_RETURN(int64_t item, in.Int());
          v.push_back(item);
        }
        op.attrs.Set(name, std::move(v));
      } else {
        return InvalidArgument("malformed layer program: attribute '{}' has type '{}'", name, type);
      }
    }
    program.ops.push_back(std::move(op));
  }
  TESSERA_RETURN_IF_ERROR(in.Expect("R"));
  TESSERA_ASSIGN_OR_RETURN(int64_t outputs, in.Count(kMaxItems));
  if (outputs == 0) return InvalidArgument("malformed layer program: it has no outputs");
  for (int64_t i = 0; i < outputs; ++i) {
    TESSERA_ASSIGN_OR_RETURN(int64_t value, in.Count(values - 1));
    program.outputs.push_back(static_cast<int>(value));
  }
  if (!in.AtEnd()) return InvalidArgument("malformed layer program: text after its outputs");
  return program;
}

// ---- Inference ----

namespace {

std::string OpLabel(const ProgramOp& op) {
  return op.label.empty() ? fmt::format("op '{}'", op.op)
                          : fmt::format("'{}' (op '{}')", op.label, op.op);
}

bool IsFloat(const TensorMeta& meta) { return meta.dtype == DType::kF32; }

}  // namespace

Result<ProgramShapes> InferProgram(const OpRegistry& registry, const LayerProgram& program,
                                   const std::vector<TensorMeta>& inputs) {
  if (static_cast<int>(inputs.size()) != program.inputs) {
    return InvalidArgument("the layer program takes {} input(s), got {}", program.inputs,
                           inputs.size());
  }
  ProgramShapes shapes;
  const Device device = inputs.empty() ? Device::Cpu() : inputs[0].device;
  for (const TensorMeta& input : inputs) {
    shapes.values.push_back(input);
    shapes.needs_gradient.push_back(false);
  }
  for (int i : program.gradient_inputs) {
    if (!IsFloat(inputs[static_cast<size_t>(i)])) {
      return InvalidArgument("layer input {} is {}: only f32 inputs have gradients", i,
                             inputs[static_cast<size_t>(i)].ToString());
    }
    shapes.needs_gradient[static_cast<size_t>(i)] = true;
  }
  for (const FlatSlot& slot : program.params.slots()) {
    shapes.values.push_back(TensorMeta{slot.shape, DType::kF32, device});
    shapes.needs_gradient.push_back(true);
  }
  for (const SharedGroup& group : program.shared) {
    for (int slot : group.slots) {
      shapes.values.push_back(
          TensorMeta{group.params.slots()[static_cast<size_t>(slot)].shape, DType::kF32, device});
      shapes.needs_gradient.push_back(true);
    }
  }
  // Values the backward reads: what each rule on the gradient's path takes from its forward.
  std::vector<bool> read_by_backward(static_cast<size_t>(program.num_values()), false);
  for (const ProgramOp& op : program.ops) {
    std::vector<TensorMeta> metas;
    bool on_path = false;
    for (int v : op.inputs) {
      if (v < 0 || v >= static_cast<int>(shapes.values.size())) {
        return InvalidArgument("{} reads value {}, which is not made before it", OpLabel(op), v);
      }
      metas.push_back(shapes.values[static_cast<size_t>(v)]);
      on_path = on_path || shapes.needs_gradient[static_cast<size_t>(v)];
    }
    Result<std::vector<TensorMeta>> outputs = registry.InferShapes(op.op, metas, op.attrs);
    if (!outputs.ok()) return outputs.status().WithContext(OpLabel(op));
    if (static_cast<int>(outputs->size()) != op.outputs) {
      return InvalidArgument("{} makes {} output(s), the program expects {}", OpLabel(op),
                             outputs->size(), op.outputs);
    }
    TESSERA_ASSIGN_OR_RETURN(const OpDef* def, registry.Find(op.op));
    const int first = static_cast<int>(shapes.values.size());
    for (const TensorMeta& meta : *outputs) {
      shapes.values.push_back(meta);
      shapes.needs_gradient.push_back(on_path && IsFloat(meta));
    }
    if (!on_path) continue;
    if (!def->gradient) {
      return InvalidArgument(
          "{} has no gradient rule, but a gradient flows through it (from a parameter or an f32 "
          "input): use an op with one, or a hand-written layer op",
          OpLabel(op));
    }
    for (const GradientRule::Arg& arg : def->gradient->inputs) {
      if (arg.from == GradientRule::From::kInput) {
        read_by_backward[static_cast<size_t>(op.inputs[static_cast<size_t>(arg.index)])] = true;
      } else if (arg.from == GradientRule::From::kOutput) {
        read_by_backward[static_cast<size_t>(first) + static_cast<size_t>(arg.index)] = true;
      }
    }
  }
  for (int v : program.outputs) {
    if (v < 0 || v >= static_cast<int>(shapes.values.size())) {
      return InvalidArgument("the layer program returns value {}, which it does not make", v);
    }
  }
  if (program.loss && (shapes.values[static_cast<size_t>(program.outputs[0])].numel() != 1 ||
                       !IsFloat(shapes.values[static_cast<size_t>(program.outputs[0])]))) {
    return InvalidArgument("a loss layer's first output must be an f32 scalar, got {}",
                           shapes.values[static_cast<size_t>(program.outputs[0])].ToString());
  }
  const int made = program.num_leaf_values();
  int64_t bytes = 0;
  for (int v = made; v < program.num_values(); ++v) {
    if (!read_by_backward[static_cast<size_t>(v)]) continue;
    shapes.saved.push_back(v);
    shapes.saved_offset.push_back(bytes);
    bytes += (shapes.values[static_cast<size_t>(v)].bytes() + 63) / 64 * 64;
  }
  shapes.saved_floats = std::max<int64_t>(1, bytes / 4);
  return shapes;
}

// ---- layer_forward / layer_backward definitions ----

namespace {

using Metas = std::vector<TensorMeta>;

Result<LayerProgram> ProgramOf(const Attrs& attrs) {
  TESSERA_ASSIGN_OR_RETURN(std::string text, attrs.GetString(kProgramAttr));
  return LayerProgram::Decode(text);
}

bool HasParams(const LayerProgram& program) { return program.params.numel() > 0; }

// The seeded outputs take no gradient input: a loss program's output 0.
int GradientInputs(const LayerProgram& program) {
  return static_cast<int>(program.outputs.size()) - (program.loss ? 1 : 0);
}

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
  TESSERA_ASSIGN_OR_RETURN(ProgramShapes shapes, InferProgram(registry, program, inputs));
  Metas out;
  for (int v : program.outputs) out.push_back(shapes.values[static_cast<size_t>(v)]);
  const Device device = in.empty() ? Device::Cpu() : in[0].device;
  out.push_back(TensorMeta{Shape{shapes.saved_floats}, DType::kF32, device});
  return out;
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

bool IsParamValue(const LayerProgram& program, int value) {
  return value >= program.first_param() && value < program.num_leaf_values();
}

Result<SplitPlan> PlanSplit(const OpRegistry& registry, const LayerProgram& program,
                            const ProgramShapes& shapes) {
  SplitPlan plan;
  plan.half.assign(program.ops.size(), Half::kNone);
  std::vector<bool> has_gradient(static_cast<size_t>(program.num_values()), false);
  for (int v : program.outputs) has_gradient[static_cast<size_t>(v)] = true;
  int64_t bytes = 0;
  const auto stash = [&](size_t op, bool param_part, size_t index, const TensorMeta& meta) {
    bytes = PaddedNumel(bytes, 64);
    plan.stash.push_back(StashEntry{op, param_part, index, meta, bytes});
    bytes += meta.bytes();
  };
  for (size_t i = program.ops.size(); i-- > 0;) {
    const ProgramOp& op = program.ops[i];
    const int first = program.first_output(i);
    bool gradient = false, wants = false;
    for (int o = 0; o < op.outputs; ++o)
      gradient |= has_gradient[static_cast<size_t>(first) + static_cast<size_t>(o)];
    for (int v : op.inputs) wants |= shapes.needs_gradient[static_cast<size_t>(v)];
    if (!gradient || !wants) continue;
    TESSERA_ASSIGN_OR_RETURN(const OpDef* def, registry.Find(op.op));
    const GradientRule& rule = *def->gradient;  // InferProgram checked it exists on the path
    bool any_param = false, any_input = false, splits = !rule.input_op.empty();
    for (size_t j = 0; j < rule.gradient_of.size(); ++j) {
      const int v = op.inputs[static_cast<size_t>(rule.gradient_of[j])];
      if (!shapes.needs_gradient[static_cast<size_t>(v)]) continue;
      has_gradient[static_cast<size_t>(v)] = true;
      const bool param = IsParamValue(program, v);
      (param ? any_param : any_input) = true;
      if (param != (static_cast<int>(j) >= rule.split_at)) splits = false;
    }
    Half& half = plan.half[i];
    half = !any_param ? Half::kFull
                      : (!any_input ? Half::kDeferred : (splits ? Half::kSplit : Half::kFull));
    if (half == Half::kFull) {
      for (size_t j = 0; j < rule.gradient_of.size(); ++j) {
        const int v = op.inputs[static_cast<size_t>(rule.gradient_of[j])];
        if (shapes.needs_gradient[static_cast<size_t>(v)] && IsParamValue(program, v)) {
          stash(i, true, j, shapes.values[static_cast<size_t>(v)]);
        }
      }
    } else {
      for (size_t a = 0; a < rule.inputs.size(); ++a) {
        if (rule.inputs[a].from != GradientRule::From::kOutputGradient) continue;
        stash(
            i, false, a,
            shapes.values[static_cast<size_t>(first) + static_cast<size_t>(rule.inputs[a].index)]);
      }
    }
  }
  plan.stash_floats = std::max<int64_t>(1, (bytes + 3) / 4);
  return plan;
}

// Which backward a kernel or inference is for: the whole one, or a half of the split one.
enum class BackwardPart : uint8_t { kAll, kInput, kWeight };

// The inputs of a backward: `lead` tensors first (the output gradients; the weight half's
// stash), then the layer's inputs, `saved`, and the groups. Returns what the program makes of
// the layer's inputs, after checking the saved buffer and groups.
Result<ProgramShapes> CheckBackwardInputs(const OpRegistry& registry, const LayerProgram& program,
                                          const Metas& in, size_t lead, const Attrs& attrs) {
  const size_t layer_inputs = static_cast<size_t>(program.inputs);
  const Metas inputs(in.begin() + static_cast<long>(lead),
                     in.begin() + static_cast<long>(lead + layer_inputs));
  TESSERA_ASSIGN_OR_RETURN(ProgramShapes shapes, InferProgram(registry, program, inputs));
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
                           CheckBackwardInputs(registry, program, in, lead, attrs));
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
          if (part != BackwardPart::kAll) cost = OpCost{cost.flops / 2, cost.bytes / 2};
          return cost;
        },
    }));
  }
  return Status::Ok();
}

// ---- Kernels ----

namespace {

using Tensors = std::vector<Tensor>;

// Runs `op` from the registry on `inputs` into `outputs` (allocated when undefined); in-place
// outputs start as a copy of their input.
Status RunOp(const KernelContext& context, DeviceKind device, const std::string& op,
             const Tensors& inputs, Tensors& outputs, const Attrs& attrs) {
  const OpRegistry& registry = *context.registry;
  Metas metas;
  for (const Tensor& t : inputs) metas.push_back(t.meta());
  TESSERA_ASSIGN_OR_RETURN(Metas out_metas, registry.InferShapes(op, metas, attrs));
  outputs.resize(out_metas.size());
  for (size_t i = 0; i < out_metas.size(); ++i) {
    if (!outputs[i].defined()) {
      TESSERA_ASSIGN_OR_RETURN(outputs[i], Tensor::Empty(out_metas[i], context.allocator));
    }
  }
  TESSERA_ASSIGN_OR_RETURN(const OpDef* def, registry.Find(op));
  for (const auto& [in, out] : def->in_place) {
    const Tensor& source = inputs[static_cast<size_t>(in)];
    const Tensor& target = outputs[static_cast<size_t>(out)];
    if (target.raw_data() != source.raw_data()) {
      std::memcpy(target.raw_data(), source.raw_data(), static_cast<size_t>(source.bytes()));
    }
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

// Where each value of a forward is stored: its own place, or (donation) the place of the output
// of the in-place op that overwrites it, when that op is its last reader and nothing else keeps
// it (not kept for the backward, not an output of the layer, made by an earlier op, same size):
// the in-place op then finds its input already there instead of copying it (a classifier's
// logits become their gradient in place). Chains resolve to the last value's place.
Result<std::vector<int>> Donations(const OpRegistry& registry, const LayerProgram& program,
                                   const ProgramShapes& shapes) {
  const size_t n = static_cast<size_t>(program.num_values());
  std::vector<int> home(n), last_reader(n, -1);
  for (size_t v = 0; v < n; ++v) home[v] = static_cast<int>(v);
  std::vector<bool> kept(n, false);
  for (int v : program.outputs) kept[static_cast<size_t>(v)] = true;
  for (int v : shapes.saved) kept[static_cast<size_t>(v)] = true;
  for (size_t i = 0; i < program.ops.size(); ++i) {
    for (int v : program.ops[i].inputs) last_reader[static_cast<size_t>(v)] = static_cast<int>(i);
  }
  const int made = program.num_leaf_values();
  for (size_t i = 0; i < program.ops.size(); ++i) {
    const ProgramOp& op = program.ops[i];
    TESSERA_ASSIGN_OR_RETURN(const OpDef* def, registry.Find(op.op));
    for (const auto& [in, out] : def->in_place) {
      const int v = op.inputs[static_cast<size_t>(in)];
      const int w = program.first_output(i) + out;
      if (v < made || kept[static_cast<size_t>(v)] ||
          last_reader[static_cast<size_t>(v)] != static_cast<int>(i) ||
          shapes.values[static_cast<size_t>(v)].bytes() !=
              shapes.values[static_cast<size_t>(w)].bytes()) {
        continue;
      }
      // Read only once, by this op: no other input of it is v.
      if (std::count(op.inputs.begin(), op.inputs.end(), v) != 1) continue;
      home[static_cast<size_t>(v)] = w;
    }
  }
  for (size_t v = n; v-- > 0;) {  // a value's home comes after it: resolve from the back
    home[v] = home[static_cast<size_t>(home[v])];
  }
  return home;
}

Status ForwardKernel(DeviceKind device, const KernelContext& context, const Tensors& in,
                     const Tensors& out, const Attrs& attrs) {
  TESSERA_RETURN_IF_ERROR(CheckRegistry(context));
  TESSERA_ASSIGN_OR_RETURN(LayerProgram program, ProgramOf(attrs));
  Metas input_metas;
  for (int i = 0; i < program.inputs; ++i) input_metas.push_back(in[static_cast<size_t>(i)].meta());
  TESSERA_ASSIGN_OR_RETURN(ProgramShapes shapes,
                           InferProgram(*context.registry, program, input_metas));
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
        TESSERA_ASSIGN_OR_RETURN(
            storage, Tensor::Empty(shapes.values[static_cast<size_t>(root)], context.allocator));
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
  for (size_t o = 0; o < program.outputs.size(); ++o) {
    const Tensor& value = values[static_cast<size_t>(program.outputs[o])];
    if (value.raw_data() == out[o].raw_data()) continue;  // made in place
    std::memcpy(out[o].raw_data(), value.raw_data(), static_cast<size_t>(value.bytes()));
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
      TESSERA_ASSIGN_OR_RETURN(sum, sum.Clone(context_.allocator));
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
void WriteGroupGradient(const GradientSums& sums, const FlatLayout& layout,
                        const std::vector<int>& slots, int first_value, const Tensor& group) {
  std::memset(group.raw_data(), 0, static_cast<size_t>(group.bytes()));
  for (size_t i = 0; i < slots.size(); ++i) {
    const Tensor& sum = sums.of(first_value + static_cast<int>(i));
    if (!sum.defined()) continue;
    const Tensor slice = ParamView(group, layout.slots()[static_cast<size_t>(slots[i])]);
    std::memcpy(slice.raw_data(), sum.raw_data(), static_cast<size_t>(slice.bytes()));
  }
}

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
  TESSERA_ASSIGN_OR_RETURN(ProgramShapes shapes, InferProgram(registry, program, input_metas));
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
  const auto stashed = [&stash](const StashEntry& entry) {
    return Tensor(entry.meta, stash.buffer(), stash.byte_offset() + entry.offset);
  };
  const auto keep = [&stashed](const StashEntry& entry, const Tensor& value) {
    std::memcpy(stashed(entry).raw_data(), value.raw_data(), static_cast<size_t>(value.bytes()));
  };

  GradientSums sums(context, device, values.size());
  if (part != BackwardPart::kWeight) {
    if (program.loss) {
      TESSERA_ASSIGN_OR_RETURN(
          Tensor seed,
          Tensor::Empty(shapes.values[static_cast<size_t>(program.outputs[0])], context.allocator));
      *seed.data<float>() = static_cast<float>(attrs.GetFloat("grad_scale", 1.0));
      TESSERA_RETURN_IF_ERROR(sums.Add(program.outputs[0], seed, true));
    }
    for (size_t o = 0; o < grads; ++o) {
      TESSERA_RETURN_IF_ERROR(
          sums.Add(program.outputs[o + (program.loss ? 1 : 0)], in[o], /*owned=*/false));
    }
  }

  size_t next_entry = 0;  // plan.stash is in the order of this loop
  for (size_t i = program.ops.size(); i-- > 0;) {
    const Half half = plan.half[i];
    if (half == Half::kNone) continue;
    const ProgramOp& op = program.ops[i];
    const int first = program.first_output(i);
    TESSERA_ASSIGN_OR_RETURN(const OpDef* def, registry.Find(op.op));
    if (!def->gradient) return Internal("op {} has no gradient rule to split", op.op);
    const GradientRule& rule = *def->gradient;
    const size_t entries = next_entry;
    while (next_entry < plan.stash.size() && plan.stash[next_entry].op == i) ++next_entry;
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
    // The rule's inputs; output gradients from the sums (zeros when none) or, in the weight
    // half, from the stash.
    Tensors inputs;
    for (size_t a = 0, entry = entries; a < rule.inputs.size(); ++a) {
      const GradientRule::Arg& arg = rule.inputs[a];
      switch (arg.from) {
        case GradientRule::From::kOutputGradient: {
          const int value = first + arg.index;
          if (part == BackwardPart::kWeight) {
            inputs.push_back(stashed(plan.stash[entry++]));
          } else if (sums.of(value).defined()) {
            inputs.push_back(sums.of(value));
          } else {
            TESSERA_ASSIGN_OR_RETURN(
                Tensor zeros,
                Tensor::Zeros(shapes.values[static_cast<size_t>(value)], context.allocator));
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
          keep(plan.stash[entry++], inputs[a]);
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
        keep(plan.stash[e], outputs[plan.stash[e].index]);
        outputs[plan.stash[e].index] = Tensor();
      }
    }
    TESSERA_RETURN_IF_ERROR(add(outputs, 0));
  }

  size_t next = 0;
  if (part != BackwardPart::kWeight) {
    for (int i : program.gradient_inputs) {
      const Tensor& target = out[next++];
      const Tensor& sum = sums.of(i);
      if (sum.defined()) {
        std::memcpy(target.raw_data(), sum.raw_data(), static_cast<size_t>(target.bytes()));
      } else {
        std::memset(target.raw_data(), 0, static_cast<size_t>(target.bytes()));
      }
    }
  }
  if (part == BackwardPart::kInput) return Status::Ok();
  if (HasParams(program)) {
    std::vector<int> every(program.params.slots().size());
    for (size_t s = 0; s < every.size(); ++s) every[s] = static_cast<int>(s);
    WriteGroupGradient(sums, program.params, every, program.first_param(), out[next++]);
  }
  for (size_t g = 0; g < program.shared.size(); ++g) {
    const SharedGroup& shared = program.shared[g];
    WriteGroupGradient(sums, shared.params, shared.slots, program.first_shared(g), out[next++]);
  }
  return Status::Ok();
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
