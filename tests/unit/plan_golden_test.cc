// Golden step graphs: a fixed set of models and plans, each planned and written as a canonical
// text dump (every task: name, op, layer, attributes, inputs and outputs by name, priority,
// pinned worker index, device kind, memory estimate, donations, control edges; every object:
// name, meta, role; the graph's outputs in order; StepGraph's cut, schedule, gather choice,
// inputs, state and gradients), compared byte for byte with tests/reference/plans/<case>.txt.
//
// The files pin the planner's output: a change to the planner that changes any graph shows up
// here as a diff of the dump, to be explained or fixed. Regenerate them, after checking that the
// change is meant, with
//   TESSERA_UPDATE_PLAN_GOLDENS=1 build/bin/plan_golden_test
// (it writes the files into the source tree and passes).
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "model/gpt2.h"
#include "model/model.h"
#include "model/unet3d.h"
#include "planner/step_graph.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

constexpr const char* kGoldenDir = "tests/reference/plans";
constexpr const char* kUpdateVariable = "TESSERA_UPDATE_PLAN_GOLDENS";

// Long strings (a layer program) are written as their length and FNV-1a hash: they come from the
// model, not the planner, and would make the files unreadable.
std::string Digest(const std::string& text) {
  uint64_t hash = 1469598103934665603ull;
  for (unsigned char c : text) hash = (hash ^ c) * 1099511628211ull;
  return fmt::format("<{} chars, fnv {:016x}>", text.size(), hash);
}

std::string AttrsText(const Attrs& attrs) {
  std::vector<std::string> parts;
  for (const auto& [name, value] : attrs.values()) {
    std::string text;
    if (const auto* s = std::get_if<std::string>(&value)) {
      text = s->size() > 160 ? Digest(*s) : "\"" + *s + "\"";
    } else if (const auto* ints = std::get_if<std::vector<int64_t>>(&value)) {
      text = fmt::format("[{}]", fmt::join(*ints, ","));
    } else if (const auto* i = std::get_if<int64_t>(&value)) {
      text = fmt::format("{}", *i);
    } else {
      text = fmt::format("{}f", std::get<double>(value));
    }
    parts.push_back(fmt::format("{}={}", name, text));
  }
  return fmt::format("{{{}}}", fmt::join(parts, ", "));
}

std::string ObjectName(const Graph& g, ObjectId id) {
  return id.valid() ? g.object(id).name : std::string("-");
}

std::string Names(const Graph& g, const std::vector<ObjectId>& ids) {
  std::vector<std::string> names;
  names.reserve(ids.size());
  for (ObjectId id : ids) names.push_back(ObjectName(g, id));
  return fmt::format("[{}]", fmt::join(names, ", "));
}

std::string WorkerIndex(const std::vector<WorkerId>& workers, WorkerId worker) {
  if (!worker.valid()) return "-";
  for (size_t i = 0; i < workers.size(); ++i) {
    if (workers[i] == worker) return std::to_string(i);
  }
  return fmt::format("?{}", worker.value());
}

std::string PieceText(const GroupPiece& piece) {
  return fmt::format("layer={} rank={} begin={} numel={}", piece.layer, piece.rank, piece.begin,
                     piece.numel);
}

// Every object and task of a graph, in id order, and its outputs in the order they were marked.
void DumpGraph(const Graph& g, const std::vector<WorkerId>& workers, std::string& out) {
  out += fmt::format("objects {}\n", g.num_objects());
  for (const ObjectSpec& object : g.objects()) {
    out += fmt::format("  {} {} {} {}\n", object.id.value(), object.name, object.meta.ToString(),
                       ObjectRoleName(object.role));
  }
  std::vector<std::string> outputs;
  for (ObjectId id : g.OutputObjects()) outputs.push_back(ObjectName(g, id));
  out += fmt::format("outputs [{}]\n", fmt::join(outputs, ", "));
  out += fmt::format("tasks {}\n", g.num_tasks());
  for (const TaskSpec& task : g.tasks()) {
    out += fmt::format("  {} {} op={} layer={} priority={} worker={} device={} memory={}\n",
                       task.id.value(), task.name, task.op, task.layer, task.priority,
                       WorkerIndex(workers, task.pinned_worker), DeviceKindName(task.device_kind),
                       task.memory_estimate_bytes);
    out += fmt::format("    attrs {}\n", AttrsText(task.attrs));
    out += fmt::format("    in {}\n", Names(g, task.inputs));
    out += fmt::format("    out {}\n", Names(g, task.outputs));
    if (!task.donations.empty()) {
      std::vector<std::string> donations;
      donations.reserve(task.donations.size());
      for (const Donation& d : task.donations) {
        donations.push_back(fmt::format("{}->{}", d.input_index, d.output_index));
      }
      out += fmt::format("    donations [{}]\n", fmt::join(donations, ", "));
    }
    if (!task.after.empty()) {
      std::vector<std::string> after;
      after.reserve(task.after.size());
      for (TaskId id : task.after) after.push_back(g.task(id).name);
      out += fmt::format("    after [{}]\n", fmt::join(after, ", "));
    }
  }
}

std::string DumpStep(const StepGraph& step) {
  const Graph& g = step.graph;
  std::string out;
  out += fmt::format("micro_batch_rows {}\n", step.micro_batch_rows);
  out += fmt::format("layer_chunk [{}]\n", fmt::join(step.layer_chunk, ","));
  out += fmt::format("layer_stage [{}]\n", fmt::join(step.layer_stage, ","));
  for (size_t s = 0; s < step.schedule_order.size(); ++s) {
    std::vector<std::string> ops;
    for (const PipelineOp& op : step.schedule_order[s]) ops.push_back(ToString(op));
    out += fmt::format("schedule stage{} {}\n", s, fmt::join(ops, " "));
  }
  out += fmt::format("schedule_costs {} {} {}\n", step.schedule_costs.forward,
                     step.schedule_costs.backward, step.schedule_costs.weight);
  out += fmt::format("gather_once_per_step {}\n", step.gather_once_per_step);
  out += fmt::format("gather_reason \"{}\"\n", step.gather_reason);
  out += fmt::format("buckets {} \"{}\" fused_reductions {}\n", step.buckets.bytes,
                     step.buckets.reason, step.fused_reductions);
  for (size_t i = 0; i < step.inputs.size(); ++i) {
    out += fmt::format("input {} {}\n", i, Names(g, step.inputs[i]));
  }
  out += fmt::format("lr {} step {} loss {} grad_norm {}\n", ObjectName(g, step.lr),
                     ObjectName(g, step.step), ObjectName(g, step.loss),
                     ObjectName(g, step.grad_norm));
  out += fmt::format("group_numel [{}]\n", fmt::join(step.group_numel, ","));
  for (const StateObject& state : step.state) {
    out += fmt::format("state {} {} worker={} in={} out={}\n", StateKindName(state.kind),
                       PieceText(state.piece), step.WorkerIndexOf(state.piece),
                       ObjectName(g, state.input), ObjectName(g, state.output));
  }
  for (const GradientObject& grad : step.grads) {
    out += fmt::format("grad {} {}\n", PieceText(grad.piece), ObjectName(g, grad.id));
  }
  DumpGraph(g, step.parallel.workers, out);
  return out;
}

std::string DumpForward(const ForwardGraph& forward) {
  const Graph& g = forward.graph;
  std::string out;
  out += fmt::format("inputs {}\n", Names(g, forward.inputs));
  out += fmt::format("params {}\n", Names(g, forward.params));
  out += fmt::format("result {}\n", ObjectName(g, forward.result));
  DumpGraph(g, {}, out);
  return out;
}

// Compares `dump` with the golden file `name`, or writes it in update mode.
void CheckGolden(const std::string& name, const std::string& dump) {
  const std::string path = SourcePath(fmt::format("{}/{}.txt", kGoldenDir, name));
  const char* update = std::getenv(kUpdateVariable);
  if (update != nullptr && std::string(update) == "1") {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    std::ofstream file(path, std::ios::binary | std::ios::trunc);
    file << dump;
    ASSERT_TRUE(file.good()) << "cannot write " << path;
    return;
  }
  if (!std::ifstream(path)) {
    ADD_FAILURE() << "no golden file " << path << ": run with " << kUpdateVariable
                  << "=1 to write it";
    return;
  }
  const std::string golden = ReadFileText(path);
  if (golden == dump) return;
  // The first line that differs, with its number, is what a reader needs to start.
  size_t line = 1, at = 0;
  while (at < golden.size() && at < dump.size() && golden[at] == dump[at]) {
    if (golden[at] == '\n') ++line;
    ++at;
  }
  auto line_at = [](const std::string& text, size_t position) {
    const size_t begin = text.rfind('\n', position == 0 ? 0 : position - 1);
    const size_t start = begin == std::string::npos ? 0 : begin + 1;
    return text.substr(start, text.find('\n', start) - start);
  };
  ADD_FAILURE() << name << ": the plan differs from " << path << " at line " << line
                << "\n  golden: " << line_at(golden, at) << "\n  now:    " << line_at(dump, at)
                << "\n(if the change is meant, regenerate with " << kUpdateVariable << "=1)";
}

// --- The models -------------------------------------------------------------------------------

ModelSpec Gpt2Tiny() { return *BuildGpt2(Gpt2Config{2, 32, 4, 50, 16}); }

ModelSpec UNetTiny() {
  Result<UNet3dConfig> config = UNet3dConfig::Preset("tiny");
  EXPECT_OK(config.status());
  Result<ModelSpec> model = BuildUNet3d(*config, CpuRegistry());
  EXPECT_OK(model.status());
  return *model;
}

// An MLP from the model API with what the planner must handle besides a chain: an activation
// read by two layers (fc1's, by fc2 and fc3) and a tied weight (the classifier reads fc2's w).
ModelSpec Mlp() {
  ModelBuilder mlp("mlp", CpuRegistry());
  ModelValue x = mlp.Input("x", DType::kF32, Shape{1, 16});
  ModelValue y = mlp.Input("y", DType::kI32, Shape{1}, /*label=*/true);
  auto linear = [](LayerBuilder& l, LayerValue in, int64_t from, int64_t to, const char* name) {
    LayerValue w = l.Param(std::string(name) + "_w", Shape{to, from}, ParamInit::Normal(0.1), true);
    LayerValue b = l.Param(std::string(name) + "_b", Shape{to}, ParamInit::Zeros());
    return l.Call("linear_forward", {in, w, b});
  };
  ModelValue h1 = mlp.Layer("fc1", {x}, [&](LayerBuilder& l) {
    return l.Call("gelu_forward", {linear(l, l.input(0), 16, 32, "fc")});
  });
  ModelValue h2 = mlp.Layer("fc2", {h1}, [&](LayerBuilder& l) {
    LayerValue w = l.Param("w", Shape{16, 32}, ParamInit::Normal(0.1), true);
    LayerValue b = l.Param("b", Shape{16}, ParamInit::Zeros());
    return l.Call("linear_forward", {l.input(0), w, b});
  });
  ModelValue h3 = mlp.Layer("fc3", {h2, h1}, [&](LayerBuilder& l) {
    return l.Call("add_forward", {l.input(0), linear(l, l.input(1), 32, 16, "skip")});
  });
  mlp.Loss("classify", {h3, y}, [](LayerBuilder& l) {
    LayerValue g = l.Param("ln_w", Shape{16}, ParamInit::Ones());
    LayerValue beta = l.Param("ln_b", Shape{16}, ParamInit::Zeros());
    LayerValue tied = l.SharedParam("fc2", "w");
    LayerValue normed = l.Call("layernorm_forward", {l.input(0), g, beta});
    return l.Call("softmax_cross_entropy", {l.Call("matmul_forward", {normed, tied}), l.input(1)});
  });
  Result<ModelSpec> model = mlp.Build();
  EXPECT_OK(model.status());
  return *model;
}

// --- The plans --------------------------------------------------------------------------------

struct PlanCase {
  std::string name;
  TrainingPlan plan;
};

// Plan fields are set through this, not a ParallelConfig literal, so the cases read the same
// whatever the fields are called.
struct Knobs {
  int ranks = 1;
  int zero = 0;
  int micro = 1;
  int stages = 1;
  int virtual_stages = 1;
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  bool clip = true;
  bool sgd = false;
  bool offload = false;
  bool offload_params = false;  // OffloadMode::kParameters (with cuda)
  bool cuda = false;
  GatherPolicy gather = GatherPolicy::kAuto;
  int prefetch = 1;
  bool split_backwards = false;
  int64_t bucket_bytes = 0;  // the cases before buckets keep one collective per group
};

TrainingPlan MakePlan(const Knobs& k, int64_t seq_len) {
  TrainingPlan plan;
  plan.batch = 8;
  plan.seq_len = seq_len;
  plan.device = k.cuda ? Device::Cuda(0) : Device::Cpu();
  if (k.sgd) plan.optimizer.kind = OptimizerConfig::Kind::kSgd;
  if (!k.clip) plan.optimizer.max_grad_norm = 0;
  ParallelConfig& p = plan.parallel;
  p.data_parallel = k.ranks;
  p.zero_stage = k.zero;
  p.micro_batches = k.micro;
  p.offload = k.offload_params ? OffloadMode::kParameters
              : k.offload      ? OffloadMode::kOptimizer
                               : OffloadMode::kNone;
  p.prefetch_layers = k.prefetch;
  p.pipeline_stages = k.stages;
  p.virtual_stages = k.virtual_stages;
  p.schedule = k.schedule;
  p.gather = k.gather;
  p.split_backwards = k.split_backwards;
  p.bucket_bytes = k.bucket_bytes;
  for (int w = 0; w < k.ranks * k.stages; ++w) p.workers.push_back(WorkerId(100 + w));
  return plan;
}

std::string CaseName(const Knobs& k) {
  std::string name = fmt::format("z{}_r{}_m{}", k.zero, k.ranks, k.micro);
  if (k.stages > 1) {
    name += fmt::format("_p{}_{}", k.stages, ScheduleName(k.schedule));
    if (k.virtual_stages > 1) name += fmt::format("_v{}", k.virtual_stages);
  }
  if (k.sgd) name += "_sgd";
  if (!k.clip) name += "_noclip";
  if (k.offload) name += "_offload";
  if (k.offload_params) name += "_offload_params";
  name += k.cuda ? "_cuda" : "_cpu";
  if (k.gather == GatherPolicy::kOncePerStep) name += "_gather_step";
  if (k.gather == GatherPolicy::kPerMicroBatch) name += "_gather_micro";
  if (k.prefetch != 1) name += fmt::format("_prefetch{}", k.prefetch);
  if (k.split_backwards) name += "_split";
  if (k.bucket_bytes == kAutoBucketBytes) name += "_bucket_auto";
  if (k.bucket_bytes > 0) name += fmt::format("_bucket{}", k.bucket_bytes);
  return name;
}

std::vector<Knobs> AllKnobs() {
  std::vector<Knobs> all;
  // ZeRO stages 0-3 at 1, 2 and 4 ranks, one and two micro-batches.
  for (int zero = 0; zero <= 3; ++zero) {
    for (int ranks : {1, 2, 4}) {
      for (int micro : {1, 2}) all.push_back({.ranks = ranks, .zero = zero, .micro = micro});
    }
  }
  for (int zero = 0; zero <= 3; ++zero) {
    all.push_back({.ranks = 2, .zero = zero, .micro = 2, .clip = false});
    all.push_back({.ranks = 2, .zero = zero, .micro = 1, .offload = true});  // on CPU: a no-op
    for (int micro : {1, 2}) {
      all.push_back({.ranks = 2, .zero = zero, .micro = micro, .offload = true, .cuda = true});
    }
    all.push_back(
        {.ranks = 2, .zero = zero, .micro = 1, .clip = false, .offload = true, .cuda = true});
  }
  for (int zero : {0, 3}) all.push_back({.ranks = 2, .zero = zero, .micro = 2, .cuda = true});
  all.push_back({.ranks = 1, .micro = 1, .sgd = true});
  all.push_back({.ranks = 2, .micro = 2, .sgd = true});
  all.push_back({.ranks = 2, .micro = 1, .sgd = true, .offload = true, .cuda = true});
  all.push_back(
      {.ranks = 1, .micro = 2, .clip = false, .sgd = true, .offload = true, .cuda = true});
  // Parameter offload on GPU workers: one rank (with and without clipping, two micro-batches),
  // data parallel, ZeRO-3 (shards uploaded, then gathered), and a two-stage pipeline.
  all.push_back({.ranks = 1, .micro = 1, .offload_params = true, .cuda = true});
  all.push_back({.ranks = 1, .micro = 2, .clip = false, .offload_params = true, .cuda = true});
  all.push_back({.ranks = 2, .zero = 0, .micro = 1, .offload_params = true, .cuda = true});
  all.push_back({.ranks = 2, .zero = 3, .micro = 2, .offload_params = true, .cuda = true});
  all.push_back({.ranks = 1, .micro = 4, .stages = 2, .offload_params = true, .cuda = true});
  // ZeRO-3's gathers: once per step when asked, and prefetch distances.
  all.push_back({.ranks = 2, .zero = 3, .micro = 2, .gather = GatherPolicy::kOncePerStep});
  all.push_back({.ranks = 2, .zero = 3, .micro = 1, .prefetch = 0});
  all.push_back({.ranks = 2, .zero = 3, .micro = 2, .prefetch = 2});
  // Split backwards without a pipeline (a profiling run).
  all.push_back({.ranks = 1, .micro = 1, .split_backwards = true});
  all.push_back({.ranks = 2, .zero = 2, .micro = 2, .split_backwards = true});
  // Pipelines of two stages under every schedule, ZeRO 0 (one rank a stage) and 3 (two).
  for (PipelineSchedule schedule : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B,
                                    PipelineSchedule::kInterleaved, PipelineSchedule::kZbH1}) {
    const int v = schedule == PipelineSchedule::kInterleaved ? 2 : 1;
    all.push_back({.ranks = 1,
                   .zero = 0,
                   .micro = 4,
                   .stages = 2,
                   .virtual_stages = v,
                   .schedule = schedule});
    all.push_back({.ranks = 2,
                   .zero = 3,
                   .micro = 4,
                   .stages = 2,
                   .virtual_stages = v,
                   .schedule = schedule});
  }
  for (int zero : {1, 2}) {
    all.push_back({.ranks = 2, .zero = zero, .micro = 2, .stages = 2});
  }
  all.push_back(
      {.ranks = 2, .zero = 3, .micro = 2, .stages = 2, .gather = GatherPolicy::kPerMicroBatch});
  all.push_back({.ranks = 2, .zero = 2, .micro = 2, .stages = 2, .offload = true, .cuda = true});
  all.push_back({.ranks = 1,
                 .zero = 0,
                 .micro = 2,
                 .stages = 2,
                 .schedule = PipelineSchedule::kZbH1,
                 .clip = false,
                 .offload = true,
                 .cuda = true});
  // Gradient buckets: small enough to fuse some groups and not others, under data parallel
  // (all-reduces after the last micro-batch) and ZeRO-2/3 (reduce-scatters per micro-batch), in
  // a pipeline (buckets end at a stage's edge), and sized from an unmeasured link.
  for (int zero : {0, 2, 3}) {
    all.push_back({.ranks = 2, .zero = zero, .micro = 2, .bucket_bytes = 40'000});
  }
  all.push_back({.ranks = 4, .zero = 2, .micro = 1, .bucket_bytes = 40'000});
  all.push_back({.ranks = 2,
                 .zero = 3,
                 .micro = 4,
                 .stages = 2,
                 .schedule = PipelineSchedule::k1F1B,
                 .bucket_bytes = 40'000});
  all.push_back({.ranks = 2, .zero = 2, .micro = 1, .bucket_bytes = kAutoBucketBytes});
  return all;
}

void CheckModel(const std::string& model_name, const ModelSpec& model, int64_t seq_len) {
  for (const Knobs& knobs : AllKnobs()) {
    const std::string name = model_name + "/" + CaseName(knobs);
    SCOPED_TRACE(name);
    const TrainingPlan plan = MakePlan(knobs, seq_len);
    Result<StepGraph> step = PlanTrainingStep(model, plan, CpuRegistry());
    ASSERT_OK(step.status());
    CheckGolden(name, DumpStep(*step));
  }
  // Cut by given costs, and zb-h1 ordered by measured F, B and W.
  TrainingPlan costed = MakePlan({.micro = 2, .stages = 2}, seq_len);
  costed.parallel.layer_costs.assign(model.layers.size(), 1.0);
  costed.parallel.layer_costs[0] = 5.0;
  ASSERT_OK_AND_ASSIGN(StepGraph by_costs, PlanTrainingStep(model, costed, CpuRegistry()));
  CheckGolden(model_name + "/layer_costs_p2_1f1b", DumpStep(by_costs));
  TrainingPlan measured =
      MakePlan({.micro = 2, .stages = 2, .schedule = PipelineSchedule::kZbH1}, seq_len);
  measured.parallel.layer_op_costs.assign(model.layers.size(), OpCosts{1, 1, 0.5});
  measured.parallel.layer_op_costs.back() = OpCosts{3, 2, 0};
  ASSERT_OK_AND_ASSIGN(StepGraph by_measure, PlanTrainingStep(model, measured, CpuRegistry()));
  CheckGolden(model_name + "/layer_op_costs_p2_zb-h1", DumpStep(by_measure));
  // Forward-only graphs: evaluation and prediction, groups padded or not, on the CPU or a GPU.
  for (int64_t multiple : {1, 2}) {
    for (Device device : {Device::Cpu(), Device::Cuda(0)}) {
      const std::string suffix =
          fmt::format("_pad{}_{}", multiple, device.is_cpu() ? "cpu" : "cuda");
      ASSERT_OK_AND_ASSIGN(ForwardGraph eval,
                           PlanEvalLoss(model, 4, seq_len, CpuRegistry(), multiple, device));
      CheckGolden(fmt::format("{}/eval{}", model_name, suffix), DumpForward(eval));
      ASSERT_OK_AND_ASSIGN(ForwardGraph logits,
                           PlanLogits(model, 4, seq_len, CpuRegistry(), multiple, device));
      CheckGolden(fmt::format("{}/logits{}", model_name, suffix), DumpForward(logits));
    }
  }
}

TEST(PlanGoldenTest, Gpt2TinyPlansAreUnchanged) { CheckModel("gpt2", Gpt2Tiny(), 16); }

TEST(PlanGoldenTest, UNetTinyPlansAreUnchanged) { CheckModel("unet3d", UNetTiny(), 1); }

TEST(PlanGoldenTest, ModelApiMlpPlansAreUnchanged) { CheckModel("mlp", Mlp(), 1); }

}  // namespace
}  // namespace tessera::testing
