// The single-worker planner's step graph, and the trainer that runs it.
#include "planner/step_graph.h"

#include <set>
#include <string>
#include <vector>

#include "core/collective_task.h"
#include "gpt2_test_util.h"
#include "model/unet3d.h"
#include "ops/cpu/cpu_kernels.h"
#include "test_util.h"
#include "training/trainer.h"

namespace tessera::testing {
namespace {

Gpt2Config TinyConfig() { return Gpt2Config{2, 32, 4, 50, 16}; }

TrainingPlan TinyPlan() {
  TrainingPlan plan;
  plan.batch = 2;
  plan.seq_len = 16;
  return plan;
}

TEST(StepGraphTest, OneForwardAndBackwardPerLayerAndOneUpdatePerGroup) {
  const ModelSpec model = *BuildGpt2(TinyConfig());
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, TinyPlan(), CpuRegistry()));
  const Graph& g = step.graph;
  for (const char* name :
       {"embedding/forward", "h.0/forward", "h.1/forward", "head/forward", "head/backward",
        "h.1/backward", "h.0/backward", "embedding/backward", "clip", "embedding/adamw",
        "h.0/adamw", "h.1/adamw", "head/adamw", "h.1/grad_norm"}) {
    EXPECT_TRUE(g.FindTask(name).ok()) << name;
  }
  // 4 layers: 4 forward + 4 backward + 4 norms + clip + 4 updates.
  EXPECT_EQ(g.num_tasks(), 17);
  ASSERT_EQ(step.group_numel.size(), 4u);
  ASSERT_EQ(step.state.size(), 3u * 4u);  // params and two moments per group
  const int64_t params = model.NumParameters();
  EXPECT_EQ(params, TinyConfig().NumParameters());
  EXPECT_EQ(g.BytesOfRole(ObjectRole::kGradient) -
                g.object(*g.FindObject("embedding.grad_from_head")).meta.bytes(),
            4 * params);
  // Inputs (params, moments) and outputs (their next values) of the optimizer state.
  EXPECT_EQ(g.BytesOfRole(ObjectRole::kOptimizerState), int64_t{4} * 4 * params);
  // The optimizer updates in place; the block backward works in place on its gradient.
  EXPECT_EQ(g.task(*g.FindTask("h.0/adamw")).donations.size(), 3u);
  EXPECT_EQ(g.task(*g.FindTask("h.1/backward")).donations.size(), 1u);
  EXPECT_EQ(g.task(*g.FindTask("embedding/backward")).donations.size(), 1u);
  // Every task's layer is set for messages and traces.
  EXPECT_EQ(g.task(*g.FindTask("h.1/backward")).layer, "h.1");
}

TrainingPlan ZeroPlan(int workers, int stage, int accum = 1) {
  TrainingPlan plan = TinyPlan();
  plan.batch = 4;
  plan.parallel.data_parallel = workers;
  plan.parallel.zero_stage = stage;
  plan.parallel.micro_batches = accum;
  plan.parallel.bucket_bytes = 0;  // one collective per group, as the table counts them
  for (int r = 0; r < workers; ++r) plan.parallel.workers.push_back(WorkerId(10 + r));
  return plan;
}

int CountOp(const Graph& g, const std::string& op) {
  int count = 0;
  for (const TaskSpec& task : g.tasks()) count += task.op == op;
  return count;
}

// Where each stage puts things, read off the graph: the collectives it adds, the shapes of the
// state, and every task pinned to its rank's worker.
TEST(StepGraphTest, ZeroStagesPlaceStateAndCollectivesAsTheTableSays) {
  const ModelSpec model = *BuildGpt2(TinyConfig());
  const int64_t layers = static_cast<int64_t>(model.layers.size());
  for (int stage = 0; stage <= 3; ++stage) {
    ASSERT_OK_AND_ASSIGN(StepGraph step,
                         PlanTrainingStep(model, ZeroPlan(2, stage), CpuRegistry()));
    const Graph& g = step.graph;
    // Per rank: one gradient reduction per group, the optimizer on its own state.
    EXPECT_EQ(CountOp(g, "all_reduce"),
              2 * (stage == 0 ? layers : 0) + int64_t{2} * (1 + (stage > 0)))
        << "stage " << stage << ": gradients + loss (+ grad norm when sharded)";
    EXPECT_EQ(CountOp(g, "reduce_scatter"), stage == 0 ? 0 : 2 * layers) << "stage " << stage;
    EXPECT_EQ(CountOp(g, "all_gather_in_place"), stage == 1 || stage == 2 ? 2 * layers : 0);
    // ZeRO-3 gathers every block twice (forward, backward), the embedding twice (forward,
    // head) and the head once.
    EXPECT_EQ(CountOp(g, "all_gather"), stage == 3 ? 2 * (2 * (layers - 2) + 2 + 1) : 0);
    for (const StateObject& object : step.state) {
      const int64_t full = step.group_numel[object.piece.layer];
      const bool sharded = object.kind == StateKind::kParameter ? stage == 3 : stage >= 1;
      EXPECT_EQ(object.piece.numel, sharded ? full / 2 : full);
      EXPECT_EQ(object.piece.begin, sharded ? object.piece.rank * full / 2 : 0);
      EXPECT_EQ(g.object(object.input).meta.numel(), object.piece.numel);
    }
    for (const TaskSpec& task : g.tasks()) {
      const bool rank1 = task.name.starts_with("rank1/");
      EXPECT_EQ(task.pinned_worker, WorkerId(rank1 ? 11 : 10)) << task.name;
    }
    // Groups are padded to equal shards from stage 1 on.
    for (size_t l = 0; l < model.layers.size(); ++l) {
      EXPECT_EQ(step.group_numel[l] % (stage >= 1 ? 2 : 1), 0);
      EXPECT_LT(step.group_numel[l] - model.layers[l].params.numel(), 2);
    }
  }
  // ZeRO-3 prefetch: a block's forward gather waits for the activation entering the layer
  // before it (a control edge after its producer), so at most two layers are gathered at once.
  ASSERT_OK_AND_ASSIGN(StepGraph z3, PlanTrainingStep(model, ZeroPlan(2, 3), CpuRegistry()));
  const TaskSpec& gather = z3.graph.task(*z3.graph.FindTask("rank0/h.1/gather_forward"));
  EXPECT_EQ(gather.inputs.size(), 1u);
  ASSERT_EQ(gather.after.size(), 1u);
  EXPECT_EQ(gather.after[0], *z3.graph.FindTask("rank0/embedding/forward"));
  EXPECT_EQ(z3.graph.object(gather.outputs[0]).role, ObjectRole::kGatheredParameter);
  // Accumulation: K micro-batches per rank, each a forward and backward, summed in place.
  ASSERT_OK_AND_ASSIGN(StepGraph accum, PlanTrainingStep(model, ZeroPlan(2, 2, 2), CpuRegistry()));
  EXPECT_EQ(accum.inputs[0].size(), 4u);  // tokens: 2 ranks x 2 micro-batches
  EXPECT_EQ(accum.micro_batch_rows, 1);
  EXPECT_EQ(CountOp(accum.graph, "accumulate"), 2 * layers);
  EXPECT_EQ(CountOp(accum.graph, "tied_lm_head_forward"), 4);
}

// Whether task `later` (transitively) reads an output of task `earlier`.
bool DependsOn(const Graph& g, TaskId later, TaskId earlier) {
  std::vector<TaskId> stack{later};
  std::set<uint64_t> seen;
  while (!stack.empty()) {
    const TaskSpec& task = g.task(stack.back());
    stack.pop_back();
    std::vector<TaskId> before = task.after;  // control edges and the inputs' producers
    for (ObjectId input : task.inputs) before.push_back(g.object(input).producer);
    for (TaskId producer : before) {
      if (!producer.valid() || !seen.insert(producer.value()).second) continue;
      if (producer == earlier) return true;
      stack.push_back(producer);
    }
  }
  return false;
}

TEST(StepGraphTest, OffloadPutsMasterWeightsAndAdamOnTheHostAndStreamsGradientsThroughIt) {
  const ModelSpec model = *BuildGpt2(TinyConfig());
  const int64_t layers = static_cast<int64_t>(model.layers.size());
  for (int stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    TrainingPlan plan = ZeroPlan(2, stage);
    plan.device = Device::Cuda(0);
    ASSERT_OK_AND_ASSIGN(StepGraph plain, PlanTrainingStep(model, plan, CpuRegistry()));
    EXPECT_EQ(CountOp(plain.graph, "copy"), 0);
    for (const ObjectSpec& object : plain.graph.objects()) {
      EXPECT_EQ(object.meta.device, Device::Cuda(0)) << object.name;
    }
    plan.parallel.offload = OffloadMode::kOptimizer;
    ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
    const Graph& g = step.graph;
    // Per rank and layer: the gradient down, the parameters up; per rank the clipping factor.
    EXPECT_EQ(CountOp(g, "copy"), 2 * (2 * layers + 1));
    // Stages 1-2 gather the uploaded shards into full parameters (no in-place gather left).
    EXPECT_EQ(CountOp(g, "all_gather_in_place"), 0);
    EXPECT_EQ(CountOp(g, "all_gather"),
              stage == 3 ? 2 * (2 * (layers - 2) + 2 + 1) : (stage >= 1 ? 2 * layers : 0));
    for (const TaskSpec& task : g.tasks()) {
      const bool on_host = task.op == "adamw" || task.name.ends_with("_to_host");
      EXPECT_EQ(task.device_kind, on_host ? DeviceKind::kCpu : DeviceKind::kCuda) << task.name;
    }
    // Per rank: parameters on the GPU as the stage places them; master weights and both Adam
    // moments in the host tier, sharded from stage 1 on (12 bytes per parameter of the piece).
    std::vector<int64_t> gpu_bytes(2), host_bytes(2), full_bytes(2), shard_bytes(2);
    for (const StateObject& object : step.state) {
      const TensorMeta& meta = g.object(object.input).meta;
      const bool host = object.kind != StateKind::kParameter;
      EXPECT_EQ(meta.device, host ? Device::Cpu() : Device::Cuda(0));
      (host ? host_bytes : gpu_bytes)[object.piece.rank] += meta.bytes();
      if (object.kind == StateKind::kParameter) {
        full_bytes[object.piece.rank] += 4 * step.group_numel[object.piece.layer];
        shard_bytes[object.piece.rank] += 4 * step.group_numel[object.piece.layer] / 2;
      }
    }
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(gpu_bytes[r], stage == 3 ? shard_bytes[r] : full_bytes[r]);
      EXPECT_EQ(host_bytes[r], 3 * (stage >= 1 ? shard_bytes[r] : full_bytes[r]));
    }
    // With clipping, a gradient goes down once the clipping factor exists (after the whole
    // backward), and no more than three layers ahead of the updates: the fourth layer's download
    // waits for the first layer's update, so the host never holds every gradient at once.
    const TaskId download = *g.FindTask("rank0/h.1/grad_to_host");
    EXPECT_TRUE(DependsOn(g, download, *g.FindTask("rank0/clip_to_host")));
    EXPECT_TRUE(DependsOn(g, download, *g.FindTask("rank0/embedding/backward")));
    ASSERT_GE(layers, 4);
    const std::string fourth = model.layers[3].name, first = model.layers[0].name;
    EXPECT_TRUE(DependsOn(g, *g.FindTask("rank0/" + fourth + "/grad_to_host"),
                          *g.FindTask("rank0/" + first + "/adamw")));
    EXPECT_FALSE(DependsOn(g, *g.FindTask("rank0/" + model.layers[2].name + "/grad_to_host"),
                           *g.FindTask("rank0/" + first + "/adamw")));
    // The update reads only host objects: its inputs all come down through copies.
    const TaskSpec& adamw = g.task(*g.FindTask("rank0/h.1/adamw"));
    for (ObjectId input : adamw.inputs) {
      EXPECT_EQ(g.object(input).meta.device, Device::Cpu()) << g.object(input).name;
    }
  }
  // With clipping off, the factor is a constant: the last block's gradient goes down and its
  // offloaded update runs during the earlier layers' backward instead of waiting for the global
  // norm (only ZeRO-1, which reduces after the whole backward, waits).
  TrainingPlan unclipped = ZeroPlan(2, 2);
  unclipped.device = Device::Cuda(0);
  unclipped.parallel.offload = OffloadMode::kOptimizer;
  for (double max_norm : {1.0, 0.0}) {
    unclipped.optimizer.max_grad_norm = max_norm;
    ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, unclipped, CpuRegistry()));
    const Graph& g = step.graph;
    EXPECT_EQ(DependsOn(g, *g.FindTask("rank0/h.1/adamw"), *g.FindTask("rank0/embedding/backward")),
              max_norm > 0)
        << "max_grad_norm " << max_norm;
    EXPECT_EQ(DependsOn(g, *g.FindTask("rank0/h.1/grad_to_host"),
                        *g.FindTask("rank0/embedding/backward")),
              max_norm > 0)
        << "max_grad_norm " << max_norm;
    EXPECT_TRUE(g.IsOutput(step.grad_norm)) << "the norm is reported either way";
  }
  // In a pipeline each stage's downloads wait only for its own worker's updates (no control
  // edge couples one stage's host to another's).
  TrainingPlan piped = TinyPlan();
  piped.batch = 4;
  piped.device = Device::Cuda(0);
  piped.parallel.offload = OffloadMode::kOptimizer;
  piped.parallel.pipeline_stages = 2;
  piped.parallel.micro_batches = 2;
  piped.parallel.workers = {WorkerId(10), WorkerId(11)};
  ASSERT_OK_AND_ASSIGN(StepGraph piped_step, PlanTrainingStep(model, piped, CpuRegistry()));
  int downloads_ordered = 0;
  for (const TaskSpec& task : piped_step.graph.tasks()) {
    if (!task.name.ends_with("/grad_to_host")) continue;
    for (TaskId earlier : task.after) {
      EXPECT_EQ(piped_step.graph.task(earlier).pinned_worker, task.pinned_worker)
          << task.name << " waits for " << piped_step.graph.task(earlier).name;
      ++downloads_ordered;
    }
  }
  EXPECT_GT(downloads_ordered, 0);
  // On CPU workers the host tier is where everything lives: offload changes nothing.
  TrainingPlan cpu_plan = ZeroPlan(2, 2);
  ASSERT_OK_AND_ASSIGN(StepGraph cpu_plain, PlanTrainingStep(model, cpu_plan, CpuRegistry()));
  cpu_plan.parallel.offload = OffloadMode::kOptimizer;
  ASSERT_OK_AND_ASSIGN(StepGraph cpu_offload, PlanTrainingStep(model, cpu_plan, CpuRegistry()));
  ASSERT_EQ(cpu_offload.graph.num_tasks(), cpu_plain.graph.num_tasks());
  for (int i = 0; i < cpu_plain.graph.num_tasks(); ++i) {
    EXPECT_EQ(cpu_offload.graph.tasks()[i].name, cpu_plain.graph.tasks()[i].name);
  }
}

TEST(StepGraphTest, SgdPlanHasNoOptimizerState) {
  TrainingPlan plan = TinyPlan();
  plan.optimizer.kind = OptimizerConfig::Kind::kSgd;
  ASSERT_OK_AND_ASSIGN(StepGraph step,
                       PlanTrainingStep(*BuildGpt2(TinyConfig()), plan, CpuRegistry()));
  EXPECT_TRUE(step.graph.FindTask("h.0/sgd").ok());
  EXPECT_EQ(step.graph.BytesOfRole(ObjectRole::kOptimizerState), 0);
}

TEST(StepGraphTest, BadPlansAreRefusedWithWhatToChange) {
  const ModelSpec model = *BuildGpt2(TinyConfig());
  TrainingPlan long_sequences = TinyPlan();
  long_sequences.seq_len = 17;
  Result<StepGraph> too_long = PlanTrainingStep(model, long_sequences, CpuRegistry());
  ASSERT_FALSE(too_long.ok());
  EXPECT_NE(too_long.status().message().find("max_seq_len"), std::string::npos);
  TrainingPlan empty = TinyPlan();
  empty.batch = 0;
  EXPECT_FALSE(PlanTrainingStep(model, empty, CpuRegistry()).ok());
  Gpt2Config odd = TinyConfig();
  odd.heads = 5;
  Status heads = odd.Validate();
  ASSERT_FALSE(heads.ok());
  EXPECT_NE(heads.message().find("divisible by heads"), std::string::npos);
}

// Per task of `g`, the tasks after it (through objects and control edges), as bit sets.
std::vector<std::vector<bool>> Reachable(const Graph& g) {
  const auto n = static_cast<size_t>(g.num_tasks());
  std::vector<std::vector<bool>> after(n, std::vector<bool>(n, false));
  const std::vector<TaskId> order = *g.TopologicalOrder();
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const TaskSpec& task = g.task(*it);
    const auto mark = [&](TaskId before) {
      std::vector<bool>& theirs = after[before.value() - 1];
      theirs[task.id.value() - 1] = true;
      const std::vector<bool>& mine = after[task.id.value() - 1];
      for (size_t i = 0; i < n; ++i) theirs[i] = theirs[i] || mine[i];
    };
    for (ObjectId input : task.inputs) {
      if (g.object(input).producer.valid()) mark(g.object(input).producer);
    }
    for (TaskId before : task.after) mark(before);
  }
  return after;
}

// The forward part of a step (PlanStepForward): its tasks are the step's forwards, on the same
// workers, with every member of each collective, in the step's order; it reads the parameters and
// model inputs and no optimizer state, and gives the step's loss.
// `loss_layer`: the model's, none of whose tasks a prediction runs.
void ExpectForwardPartOf(const StepGraph& step, ForwardResult result, const std::string& label,
                         const std::string& loss_layer = "") {
  ASSERT_OK_AND_ASSIGN(StepForward forward, PlanStepForward(step, result));
  const Graph& part = forward.graph;
  EXPECT_OK(part.Validate());
  std::map<int64_t, int64_t> members, group_size;
  for (const TaskSpec& task : part.tasks()) {
    for (const char* phase : {"backward", "adamw", "grad_norm", "clip"}) {
      EXPECT_EQ(task.name.find(phase), std::string::npos) << label << ": " << task.name;
    }
    if (result == ForwardResult::kPredictions) {
      EXPECT_NE(task.layer, loss_layer) << task.name;
    }
    ASSERT_OK_AND_ASSIGN(TaskId same, step.graph.FindTask(task.name));
    EXPECT_EQ(task.pinned_worker, step.graph.task(same).pinned_worker) << task.name;
    if (task.attrs.Has(kCollectiveAttr)) {
      const int64_t id = task.attrs.GetInt(kCollectiveAttr, 0);
      ++members[id];
      group_size[id] = task.attrs.GetInt(kGroupSizeAttr, 0);
    }
  }
  EXPECT_EQ(members, group_size) << label << ": a collective lacks members";
  // Each worker's order among the kept tasks holds: whatever ran after another of its worker in
  // the step does.
  const std::vector<std::vector<bool>> step_order = Reachable(step.graph),
                                       part_order = Reachable(part);
  std::vector<size_t> index;  // part's task -> step's
  for (const TaskSpec& task : part.tasks()) {
    index.push_back(static_cast<size_t>(step.graph.FindTask(task.name)->value() - 1));
  }
  int64_t ordered = 0;
  for (size_t a = 0; a < index.size(); ++a) {
    for (size_t b = 0; b < index.size(); ++b) {
      if (!step_order[index[a]][index[b]] ||
          part.tasks()[a].pinned_worker != part.tasks()[b].pinned_worker) {
        continue;
      }
      ++ordered;
      EXPECT_TRUE(part_order[a][b])
          << label << ": " << part.tasks()[a].name << " before " << part.tasks()[b].name;
    }
  }
  EXPECT_GT(ordered, 0) << label;
  // Wherever the step fits, its forward part does: no worker's predicted host peak above the
  // step's.
  ASSERT_OK_AND_ASSIGN(MemoryProfile step_memory, PredictMemory(step.graph));
  ASSERT_OK_AND_ASSIGN(MemoryProfile part_memory, PredictMemory(part));
  std::map<WorkerId, int64_t> step_peak;
  const auto host = static_cast<size_t>(MemoryTier::kHost);
  for (const WorkerMemory& worker : step_memory.workers) {
    step_peak[worker.order.worker] = worker.peaks[host].bytes;
  }
  for (const WorkerMemory& worker : part_memory.workers) {
    EXPECT_LE(worker.peaks[host].bytes, step_peak.at(worker.order.worker)) << label;
  }
  // What it reads: model inputs (no labels when predicting) and parameters, nothing else.
  for (size_t i = 0; i < step.state.size(); ++i) {
    const bool parameter = step.state[i].kind == StateKind::kParameter;
    EXPECT_EQ(forward.state[i].valid(), parameter) << label << " state " << i;
  }
  if (result == ForwardResult::kLoss) {
    EXPECT_EQ(part.OutputObjects(), std::vector<ObjectId>{forward.loss}) << label;
    EXPECT_EQ(part.object(forward.loss).name, step.graph.object(step.loss).name) << label;
  } else {
    ASSERT_EQ(forward.predictions.size(), step.predictions.size()) << label;
    for (size_t i = 0; i < step.predictions.size(); ++i) {
      EXPECT_EQ(part.object(forward.predictions[i]).meta,
                step.graph.object(step.predictions[i]).meta)
          << label;
    }
  }
}

TEST(StepGraphTest, TheForwardPartOfAStepRunsOnItsPlacementInItsOrder) {
  const ModelSpec gpt2 = *BuildGpt2(TinyConfig());
  // ZeRO-3 over two ranks with two micro-batches: its gathers, the loss's all-reduce.
  ASSERT_OK_AND_ASSIGN(StepGraph zero3, PlanTrainingStep(gpt2, ZeroPlan(2, 3, 2), CpuRegistry()));
  ExpectForwardPartOf(zero3, ForwardResult::kLoss, "ZeRO-3");
  // A 1F1B pipeline of two stages and four micro-batches: each stage's forwards in its order.
  TrainingPlan pipeline = ZeroPlan(1, 0, 4);
  pipeline.parallel.pipeline_stages = 2;
  pipeline.parallel.schedule = PipelineSchedule::k1F1B;
  pipeline.parallel.workers = {WorkerId(10), WorkerId(11)};
  ASSERT_OK_AND_ASSIGN(StepGraph piped, PlanTrainingStep(gpt2, pipeline, CpuRegistry()));
  ExpectForwardPartOf(piped, ForwardResult::kLoss, "1F1B");
  // A U-Net in two slabs over two row groups: halos and the norms' statistics, its predictions
  // each rank's slab of the logits.
  const UNet3dConfig config = *UNet3dConfig::Preset("tiny");
  const ModelSpec unet = *BuildUNet3d(config, CpuRegistry());
  ASSERT_OK_AND_ASSIGN(ModelSpec slabs, unet.PlannedFor(1, 2, false, SequenceAttention::kHalo));
  TrainingPlan plan;
  plan.batch = 4;
  plan.parallel.data_parallel = 4;
  plan.parallel.sequence_parallel = 2;
  plan.parallel.sequence_attention = SequenceAttention::kHalo;
  for (int r = 0; r < 4; ++r) plan.parallel.workers.push_back(WorkerId(10 + r));
  ASSERT_OK_AND_ASSIGN(StepGraph sliced, PlanTrainingStep(slabs, plan, CpuRegistry()));
  ExpectForwardPartOf(sliced, ForwardResult::kLoss, "slabs");
  // Under a cap at 97% of its peak (recomputing everything needs 96%) the memory plan recomputes
  // or keeps part of some layers; the forward part keeps those layers' choices and stays under
  // the step's peak.
  TrainingPlan capped = plan;
  ASSERT_OK_AND_ASSIGN(MemoryProfile uncapped, PredictMemory(sliced.graph));
  int64_t peak = 0;
  for (const WorkerMemory& worker : uncapped.workers) {
    peak = std::max(peak, worker.peaks[static_cast<size_t>(MemoryTier::kHost)].bytes);
  }
  capped.memory.host_bytes = peak * 97 / 100;
  ASSERT_OK_AND_ASSIGN(StepGraph planned, PlanTrainingStep(slabs, capped, CpuRegistry()));
  ASSERT_FALSE(planned.memory.activations.empty());
  ExpectForwardPartOf(planned, ForwardResult::kLoss, "slabs under a cap");
  ExpectForwardPartOf(planned, ForwardResult::kPredictions, "slab predictions under a cap",
                      slabs.layers.back().name);
  ExpectForwardPartOf(sliced, ForwardResult::kPredictions, "slab predictions",
                      slabs.layers.back().name);
  const int64_t v = config.volume;
  ASSERT_EQ(sliced.predictions.size(), 4u);
  EXPECT_EQ(sliced.graph.object(sliced.predictions[3]).meta.shape,
            (Shape{2, config.classes, v / 2, v, v}));
}

std::vector<int32_t> Batch(int64_t n, int32_t vocab, uint64_t seed) {
  const Tensor tokens = RandomTokens({n}, vocab, seed);
  return std::vector<int32_t>(tokens.data<int32_t>(), tokens.data<int32_t>() + n);
}

std::vector<float> Losses(int threads, int steps, double max_grad_norm = 1.0) {
  ExecutorOptions options;
  options.threads = threads;
  TrainingPlan plan = TinyPlan();
  plan.optimizer.max_grad_norm = max_grad_norm;
  auto trainer = *Trainer::Create(*BuildGpt2(TinyConfig()), plan, options);
  EXPECT_OK(trainer->InitializeParameters(42));
  const std::vector<int32_t> tokens = Batch(32, 50, 1), targets = Batch(32, 50, 2);
  std::vector<float> losses;
  losses.reserve(static_cast<size_t>(steps));
  for (int i = 0; i < steps; ++i)
    losses.push_back(Gpt2Step(*trainer, tokens, targets, 3e-3f)->loss);
  return losses;
}

TEST(TrainerTest, ClippingOffTrainsAsALimitNeverReached) {
  // Off, the factor is the planned constant 1 (updates do not wait for the norm); a limit far
  // above the norm computes the factor 1 from the norm: the same arithmetic, bit for bit.
  EXPECT_EQ(Losses(2, 5, 0.0), Losses(2, 5, 1e30));
}

TEST(TrainerTest, LossFallsOnARepeatedBatch) {
  std::vector<float> losses = Losses(2, 30);
  EXPECT_NEAR(losses.front(), std::log(50.0), 0.1);  // near-uniform predictions at init
  EXPECT_LT(losses.back(), 0.5 * losses.front());
}

TEST(TrainerTest, ResultsDoNotDependOnTheThreadCount) {
  // Every reduction sums fixed chunks in a fixed order, so 1 and 3 threads agree bit for bit.
  EXPECT_EQ(Losses(1, 3), Losses(3, 3));
}

TEST(TrainerTest, StepReportsPeakMemoryAboveTheModelState) {
  ExecutorOptions options;
  options.threads = 2;
  auto trainer = *Trainer::Create(*BuildGpt2(TinyConfig()), TinyPlan(), options);
  ASSERT_OK(trainer->InitializeParameters(1));
  ASSERT_OK_AND_ASSIGN(StepReport report,
                       Gpt2Step(*trainer, Batch(32, 50, 1), Batch(32, 50, 2), 1e-3f));
  const int64_t state = trainer->ParameterBytes() + trainer->OptimizerStateBytes();
  EXPECT_EQ(state, 12 * TinyConfig().NumParameters());
  EXPECT_GT(report.peak_bytes, state);
  EXPECT_LT(report.peak_bytes, 3 * state + (8 << 20));
}

TEST(TrainerTest, ABadBatchIsRefusedAndTheModelIsUnchanged) {
  ExecutorOptions options;
  auto trainer = *Trainer::Create(*BuildGpt2(TinyConfig()), TinyPlan(), options);
  ASSERT_OK(trainer->InitializeParameters(1));
  const std::vector<float> before = *trainer->GetParameter("h.0.qkv_w");
  std::vector<int32_t> tokens = Batch(32, 50, 1);
  tokens[5] = 50;
  // model/gpt2.h's batch refuses it before the trainer sees it...
  Result<StepReport> bad = Gpt2Step(*trainer, tokens, Batch(32, 50, 2), 1e-3f);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("token id 50"), std::string::npos);
  EXPECT_EQ(*trainer->GetParameter("h.0.qkv_w"), before);
  // ... and given to the trainer as it is, the step fails in the embedding and hands the state
  // back untouched.
  Result<StepReport> unchecked =
      trainer->Step({IntTensor(Shape{TinyPlan().batch, TinyPlan().seq_len}, tokens),
                     IntTensor(Shape{TinyPlan().batch, TinyPlan().seq_len}, Batch(32, 50, 2))},
                    1e-3f);
  ASSERT_FALSE(unchecked.ok());
  EXPECT_NE(unchecked.status().message().find("token id 50"), std::string::npos);
  EXPECT_EQ(*trainer->GetParameter("h.0.qkv_w"), before);
  // And it still trains afterwards.
  EXPECT_OK(Gpt2Step(*trainer, Batch(32, 50, 1), Batch(32, 50, 2), 1e-3f).status());
}

}  // namespace
}  // namespace tessera::testing
