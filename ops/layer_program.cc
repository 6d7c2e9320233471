// The layer program itself: its value numbering, its text encoding, shape inference, and the
// split of its backward into an input and a weight half. The ops that run it are in
// layer_program_ops.cc, their kernels in layer_program_kernels.cc.
#include "ops/layer_program.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <set>
#include <type_traits>

#include <fmt/format.h>

#include "ops/layer_program_internal.h"
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

bool IsFloat(const TensorMeta& meta) { return meta.dtype == DType::kF32; }

}  // namespace

namespace detail {

std::string OpLabel(const ProgramOp& op) {
  return op.label.empty() ? fmt::format("op '{}'", op.op)
                          : fmt::format("'{}' (op '{}')", op.label, op.op);
}

Result<LayerProgram> ProgramOf(const Attrs& attrs) {
  TESSERA_ASSIGN_OR_RETURN(std::string text, attrs.GetString(kProgramAttr));
  TESSERA_ASSIGN_OR_RETURN(LayerProgram program, LayerProgram::Decode(text));
  // A split layer's tensor rank and a sequence-parallel rank go to every op (the
  // vocabulary-parallel ones and position_add read them).
  for (const char* name : {kTensorRankAttr, kSequenceRankAttr}) {
    if (!attrs.Has(name)) continue;
    TESSERA_ASSIGN_OR_RETURN(int64_t rank, attrs.GetInt(name));
    for (ProgramOp& op : program.ops) op.attrs.Set(name, rank);
  }
  return program;
}

Result<std::string> RebuildOf(const Attrs& attrs) {
  if (!attrs.Has(kRebuildAttr)) return std::string();
  return attrs.GetString(kRebuildAttr);
}

}  // namespace detail

Result<ProgramShapes> InferProgram(const OpRegistry& registry, const LayerProgram& program,
                                   const std::vector<TensorMeta>& inputs,
                                   std::string_view rebuild) {
  if (!rebuild.empty() && rebuild != kRebuildCheapOps) {
    return InvalidArgument("a layer program rebuilds '{}' only, not '{}'", kRebuildCheapOps,
                           rebuild);
  }
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
    if (!CarriesGradients(inputs[static_cast<size_t>(i)].dtype)) {
      return InvalidArgument("layer input {} is {}: only f32 and bf16 inputs have gradients", i,
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
  std::vector<bool> cheap;  // per op, when rebuilding: few flops per element it makes
  for (const ProgramOp& op : program.ops) {
    std::vector<TensorMeta> metas;
    bool on_path = false;
    for (int v : op.inputs) {
      if (v < 0 || v >= static_cast<int>(shapes.values.size())) {
        return InvalidArgument("{} reads value {}, which is not made before it",
                               detail::OpLabel(op), v);
      }
      metas.push_back(shapes.values[static_cast<size_t>(v)]);
      on_path = on_path || shapes.needs_gradient[static_cast<size_t>(v)];
    }
    Result<std::vector<TensorMeta>> outputs = registry.InferShapes(op.op, metas, op.attrs);
    if (!outputs.ok()) return outputs.status().WithContext(detail::OpLabel(op));
    if (static_cast<int>(outputs->size()) != op.outputs) {
      return InvalidArgument("{} makes {} output(s), the program expects {}", detail::OpLabel(op),
                             outputs->size(), op.outputs);
    }
    TESSERA_ASSIGN_OR_RETURN(const OpDef* def, registry.Find(op.op));
    if (!rebuild.empty()) {
      TESSERA_ASSIGN_OR_RETURN(OpCost cost, registry.Cost(op.op, metas, op.attrs));
      int64_t made = 0;
      for (const TensorMeta& meta : *outputs) made += meta.numel();
      cheap.push_back(cost.flops <= kCheapFlopsPerElement * static_cast<double>(made));
    }
    const int first = static_cast<int>(shapes.values.size());
    for (const TensorMeta& meta : *outputs) {
      shapes.values.push_back(meta);
      shapes.needs_gradient.push_back(on_path && CarriesGradients(meta.dtype));
    }
    if (!on_path) continue;
    if (!def->gradient) {
      return InvalidArgument(
          "{} has no gradient rule, but a gradient flows through it (from a parameter or an f32 "
          "input): use an op with one, or a hand-written layer op",
          detail::OpLabel(op));
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
  // Keeping part: from the last op back, a cheap op whose outputs the backward needs is run
  // again instead, when the values it reads that nothing else needs yet are no larger than
  // those of its outputs that are needed (each then needed in turn).
  std::vector<bool>& needed = read_by_backward;
  shapes.rebuilt.assign(program.ops.size(), false);
  for (size_t i = program.ops.size(); !rebuild.empty() && i-- > 0;) {
    const ProgramOp& op = program.ops[i];
    const auto first = static_cast<size_t>(program.first_output(i));
    int64_t freed = 0, added = 0;
    for (size_t o = first; o < first + static_cast<size_t>(op.outputs); ++o) {
      if (needed[o]) freed += shapes.values[o].bytes();
    }
    std::set<int> reads(op.inputs.begin(), op.inputs.end());
    for (int v : reads) {
      if (v >= made && !needed[static_cast<size_t>(v)]) {
        added += shapes.values[static_cast<size_t>(v)].bytes();
      }
    }
    if (freed == 0 || !cheap[i] || added > freed) continue;
    shapes.rebuilt[i] = true;
    for (size_t o = first; o < first + static_cast<size_t>(op.outputs); ++o) needed[o] = false;
    for (int v : reads) {
      if (v >= made) needed[static_cast<size_t>(v)] = true;
    }
  }
  int64_t bytes = 0;
  for (int v = made; v < program.num_values(); ++v) {
    if (!needed[static_cast<size_t>(v)]) continue;
    shapes.saved.push_back(v);
    shapes.saved_offset.push_back(bytes);
    bytes += (shapes.values[static_cast<size_t>(v)].bytes() + 63) / 64 * 64;
  }
  shapes.saved_floats = std::max<int64_t>(1, bytes / 4);
  return shapes;
}

Result<OpCost> ProgramRebuildCost(const OpRegistry& registry, const LayerProgram& program,
                                  const std::vector<TensorMeta>& inputs, std::string_view rebuild) {
  TESSERA_ASSIGN_OR_RETURN(ProgramShapes shapes, InferProgram(registry, program, inputs, rebuild));
  OpCost total;
  for (size_t i = 0; i < program.ops.size(); ++i) {
    if (!shapes.rebuilt[i]) continue;
    std::vector<TensorMeta> metas;
    for (int v : program.ops[i].inputs) metas.push_back(shapes.values[static_cast<size_t>(v)]);
    TESSERA_ASSIGN_OR_RETURN(OpCost cost,
                             registry.Cost(program.ops[i].op, metas, program.ops[i].attrs));
    total.flops += cost.flops;
    total.bytes += cost.bytes;
  }
  return total;
}

// ---- The backward's split into halves ----

namespace {

bool IsParamValue(const LayerProgram& program, int value) {
  return value >= program.first_param() && value < program.num_leaf_values();
}

}  // namespace

Result<detail::SplitPlan> detail::PlanSplit(const OpRegistry& registry, const LayerProgram& program,
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

namespace detail {

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

RebuildOrder PlanRebuild(const OpRegistry& registry, const LayerProgram& program,
                         const ProgramShapes& shapes) {
  RebuildOrder order;
  const auto n = static_cast<size_t>(program.num_values());
  order.producer.assign(n, -1);
  order.last_reader.assign(n, -1);
  for (size_t i = 0; i < program.ops.size(); ++i) {
    if (!shapes.rebuilt[i]) continue;
    for (int o = 0; o < program.ops[i].outputs; ++o) {
      const size_t v = static_cast<size_t>(program.first_output(i)) + static_cast<size_t>(o);
      order.producer[v] = static_cast<int>(i);
      order.rebuilt.push_back(v);
    }
  }
  // The walk reaches op i after every op after it, so a value is last read at the lowest op
  // that reads it: as an input (its rule, or rebuilding its outputs), or as an output (its
  // producer's rule).
  for (size_t i = program.ops.size(); i-- > 0;) {
    for (int v : program.ops[i].inputs)
      order.last_reader[static_cast<size_t>(v)] = static_cast<int>(i);
  }
  for (size_t i = 0; i < program.ops.size(); ++i) {
    if (!shapes.rebuilt[i]) continue;
    Result<const OpDef*> found = registry.Find(program.ops[i].op);
    const OpDef* def = found.ok() ? *found : nullptr;
    for (int o = 0; o < program.ops[i].outputs; ++o) {
      const auto v = static_cast<size_t>(program.first_output(i)) + static_cast<size_t>(o);
      const bool read_by_rule =
          def != nullptr && def->gradient &&
          std::any_of(def->gradient->inputs.begin(), def->gradient->inputs.end(),
                      [o](const GradientRule::Arg& arg) {
                        return arg.from == GradientRule::From::kOutput && arg.index == o;
                      });
      if (read_by_rule || order.last_reader[v] < 0) order.last_reader[v] = static_cast<int>(i);
    }
  }
  return order;
}

Result<const GradientRule*> BackwardRuleOf(const OpRegistry& registry, const ProgramOp& op) {
  TESSERA_ASSIGN_OR_RETURN(const OpDef* def, registry.Find(op.op));
  if (!def->gradient) return Internal("op {} has no gradient rule to split", op.op);
  return &*def->gradient;
}

size_t TakeStashEntries(const SplitPlan& plan, size_t op, size_t& next_entry) {
  const size_t first = next_entry;
  while (next_entry < plan.stash.size() && plan.stash[next_entry].op == op) ++next_entry;
  return first;
}

}  // namespace detail

}  // namespace tessera
