// Trainer: trains a model (any ModelSpec: model/'s language model and 3D U-Net, or one built
// with the model API) by running its step graph, one step per call.
//
// The trainer owns the model state (one flat parameter group per layer and, for AdamW, its two
// moment buffers), the step graph from the planner (zero/: one worker, data parallel or ZeRO,
// per the plan's ParallelConfig), and the backend that runs it (this process, or a cluster:
// client/graph_backend.h). The state is held as the plan places it: full groups, or shards per
// rank (StepGraph::state); the trainer reads and writes whole groups whatever the placement, so
// parameters, gradients and checkpoints do not depend on the topology. Each Step binds a batch
// (split into the ranks' micro-batches), the learning rate and the step number, moves the state
// into the run (so the optimizer updates it in place through donation), and takes the updated
// state from the graph's outputs. On a cluster the state stays on the workers between steps;
// only the loss and the gradient norm come back.
//
// The trainer knows nothing of any particular model: a step takes one host tensor per model
// input, parameters start as each layer's ParamInit says, and are named "<prefix><slot>"
// (LayerSpec::ParamPrefix: "h.0.qkv_w", "enc0.conv1.w"). Helpers that build a model's input
// tensors from its data (token ids, volumes) live with the model, in model/.
//
// Not thread-safe: one caller at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "client/graph_backend.h"
#include "core/status.h"
#include "model/model_spec.h"
#include "ops/op_registry.h"
#include "planner/step_graph.h"
#include "planner/zero_one_adam.h"
#include "worker/in_process_executor.h"

namespace tessera {

// What one rank's worker held and sent during a step.
struct RankFigures {
  int rank = 0;
  WorkerId worker;  // invalid in process
  RunFigures figures;
};

struct StepReport {
  int64_t step = 0;  // 1-based number of the step just taken
  float loss = 0;
  float grad_norm = 0;  // before clipping
  double step_ms = 0;
  int64_t peak_bytes = 0;  // peak host bytes live during the step (state included)
  // Peak bytes on the GPU during the step, in process with a GPU (0 otherwise).
  int64_t device_peak_bytes = 0;
  // Per rank (in process: the one executor; on a cluster: each rank's worker; empty for a
  // one-rank plan the scheduler placed).
  std::vector<RankFigures> ranks;
};

class Trainer {
 public:
  // Validates the model and plan and prepares the step graph on `backend` (in process, or a
  // cluster). A plan with N > 1 data-parallel ranks takes the backend's first N workers
  // (InvalidArgument when it has fewer, saying how many to start). Parameters start at zero;
  // call InitializeParameters or SetParameter first.
  static Result<std::unique_ptr<Trainer>> Create(ModelSpec model, const TrainingPlan& plan,
                                                 std::unique_ptr<GraphBackend> backend);
  // In this process, on an executor with these options.
  static Result<std::unique_ptr<Trainer>> Create(ModelSpec model, const TrainingPlan& plan,
                                                 const ExecutorOptions& executor_options);

  // Every parameter slot as its layer's ParamInit says (zeros where a layer gives none).
  // Deterministic in the seed, whatever the thread count: each slot draws from its own stream of
  // the seed (by layer and slot index), in parallel chunks. Resets the optimizer state and the
  // step count.
  Status InitializeParameters(uint64_t seed);

  // Copies values into the named parameter. InvalidArgument on an unknown name or a shape that
  // differs from the model's.
  Status SetParameter(const std::string& name, const std::vector<float>& values,
                      const Shape& shape);
  Result<std::vector<float>> GetParameter(const std::string& name);
  // The gradient of the named parameter from the last step (before clipping). Requires a step.
  Result<std::vector<float>> GetGradient(const std::string& name);
  // Every parameter name, in model order.
  std::vector<std::string> ParameterNames() const;
  // Where a named parameter lives: its layer's group and its slot there. InvalidArgument for
  // an unknown name.
  struct ParameterRef {
    size_t group;
    const FlatSlot* slot;
  };
  Result<ParameterRef> FindParameter(const std::string& name) const;

  // One training step on `batch`: one host tensor per model input (ModelSpec::inputs order),
  // dimension 0 the plan's batch (a sequence input's dimension 1 its seq_len). InvalidArgument
  // naming the input when a tensor has another shape or type, before anything runs. If the step
  // fails (e.g. a kernel refuses a token id), the model state is left as it was (or DataLoss
  // says what the optimizer had already updated).
  Result<StepReport> Step(const std::vector<Tensor>& batch, float lr);
  // Mean loss of a batch of the plan's shape, without updating anything: the step's forward part
  // on the step's own workers and placement (PlanStepForward), so a model that trains split (in
  // slabs, over tensor ranks, pipelined, sharded) evaluates split too. Equals the loss Step
  // reports for the same batch and state, to the bit.
  Result<float> EvalLoss(const std::vector<Tensor>& batch);
  // The model's prediction for a batch of any number of rows (dimension 0 of its non-label
  // inputs) and, for sequence inputs, any seq_len up to the model's (their dimension 1). Label
  // inputs are not read (they may be undefined tensors). InvalidArgument naming the input when
  // the tensors disagree.
  // A model whose loss layer has no predict_op (a U-Net: the prediction is what its loss reads
  // first) predicts on the step's placement like EvalLoss, in chunks of the plan's batch (the
  // last padded), each rank's part (its rows; its slab or positions) downloaded and joined.
  // Otherwise (a language model's logits, a seq_len other than the plan's) the whole model runs
  // on one worker (PlanLogits), a graph planned once per rows and seq_len.
  Result<Tensor> Predict(const std::vector<Tensor>& batch);

  // Keeps each step's parameter gradients readable through GetGradient (for tests and
  // debugging; they stay alive until the next step). Re-plans the step graph.
  Status SetKeepGradients(bool keep);

  // A whole group of state (GroupNumel(layer) elements), read from / written to every object
  // that holds a piece of it, whatever the placement. `layer` is the whole model's (model()),
  // also under tensor parallelism, where the group is gathered from (scattered to) the slices
  // of the split model's layers that hold its slots.
  Result<std::vector<float>> ReadGroup(size_t layer, StateKind kind);
  Status WriteGroup(size_t layer, StateKind kind, std::span<const float> values);
  // Elements of ReadGroup's groups: step_graph().group_numel[layer] (padding for ZeRO's shards
  // included); under tensor parallelism the whole model's group, unpadded.
  int64_t GroupNumel(size_t layer) const;
  // The value of step_graph().state[index] (a piece of a group on one rank).
  Result<Tensor> DownloadState(size_t index) { return backend_->Download(state_.at(index)); }
  // Writes state objects to files, each by the worker that holds it (in process: this
  // process), atomically: step_graph().state[indices[i]] to paths[i] (parent directories are
  // created). Returns what each file holds. A list of paths is planned and registered once.
  struct FileReceipt {
    int64_t bytes = 0;
    uint64_t fnv1a = 0;  // core/checksum.h
  };
  Result<std::vector<FileReceipt>> WriteState(const std::vector<size_t>& indices,
                                              const std::vector<std::string>& paths);
  // Copies of state objects, each made on a given worker (in process: here): the copy of
  // step_graph().state[indices[i]] on workers[i] (invalid: where the scheduler puts it). The
  // copies are new objects, which later steps leave as they are (training/peer_snapshot.h).
  Result<std::vector<Value>> CopyState(const std::vector<size_t>& indices,
                                       const std::vector<WorkerId>& workers);
  // The plan's index-th worker (stage * ranks + rank; invalid when the plan pins none).
  WorkerId PlanWorker(int index) const;
  // After restoring state (a checkpoint): the next Step is number steps + 1 (AdamW's bias
  // correction depends on it).
  // 0/1 Adam's schedule is replayed to that step.
  void set_steps_taken(int64_t steps);
  // Every rank holds the same parameters: true but between two of 0/1 Adam's synchronisations
  // (its local steps). Checkpoints are taken only then.
  bool parameters_synchronized() const;
  // 0/1 Adam: the number of the next step that synchronises the ranks; steps_taken() otherwise.
  int64_t NextSynchronizedStep() const;
  // 1-bit Adam after its warm-up: plans the compressed phase's step (the warm-up's state, each
  // momentum gathered whole under ZeRO-1/2, then every rank's error buffers, started at zero) and
  // runs it from the next step on. Step calls it
  // after freeze_step steps; a checkpoint load past them calls it to restore the errors. A no-op
  // for other optimizers and once in the phase.
  Status EnterCompressedPhase();
  // Writes step_graph().state[index] (its piece's elements): what has no group to go through (1-bit
  // Adam's error buffers).
  Status WriteStateObject(size_t index, std::span<const float> values);
  const StepGraph& step_graph() const { return step_graph_; }

  // The whole model, and the model the step graph runs: the same, or under tensor parallelism
  // (ParallelConfig::tensor_parallel) the split model each tensor rank runs (its layers are
  // what step_graph()'s pieces index).
  const ModelSpec& model() const { return model_; }
  const ModelSpec& planned_model() const { return split_; }
  const TrainingPlan& plan() const { return plan_; }
  int64_t steps_taken() const { return steps_taken_; }
  GraphBackend& backend() { return *backend_; }
  // The spans of the latest `steps` training steps (GraphBackend::LastTimeline of the step
  // graph; evaluation and checkpoint graphs are left out).
  Result<Timeline> StepTimeline(int steps) { return backend_->LastTimeline(step_handle_, steps); }
  // Bytes of model state: parameters, and optimizer state.
  int64_t ParameterBytes() const;
  int64_t OptimizerStateBytes() const;

 private:
  // ResourceExhausted, before anything is allocated, when the plan's host-tier state is more
  // than the backend's host memory (in process: what the machine has available), naming each
  // kind's share; when a step's inputs and the staging of the largest parameter group (both in
  // this process, whatever runs the step) are more than this machine has available; and, in
  // process, when the state, the inputs and the step's largest intermediate together are (a
  // lower bound of the step's peak), naming the flags that shrink it.
  Status CheckHostMemory() const;
  Trainer(ModelSpec model, ModelSpec split, TrainingPlan plan, std::unique_ptr<OpRegistry> registry,
          std::unique_ptr<GraphBackend> backend);

  Result<Value> Scalar(DType dtype, double value);
  // InvalidArgument naming the input unless `batch` has one tensor per model input of `rows`
  // rows and `seq_len`; label inputs only when `labels` (not when predicting).
  Status CheckBatch(const std::vector<Tensor>& batch, int64_t rows, int64_t seq_len,
                    bool labels) const;
  // Rows [first, first + rows) of a batch tensor, uploaded; with `positions` >= 0, only their
  // positions [first_position, + positions) along dimension `axis` (a sequence rank's part of
  // dimension 1, a slab's of a volume's depth).
  Result<Value> UploadRows(const Tensor& batch, int64_t first, int64_t rows, int axis = 1,
                           int64_t first_position = 0, int64_t positions = -1);
  Status PrepareStepGraph();

  // Fresh parameters (each layer's ParamInit from `seed`, or zeros) and zeroed optimizer state.
  Status AllocateState(std::optional<uint64_t> seed);
  // AllocateState under tensor parallelism: the whole groups drawn, each rank given its slices.
  Status AllocateSplitState(std::optional<uint64_t> seed);
  // The whole model's group `l` as its ParamInit draws it from `seed` (zeros where none, or
  // without a seed), into `values` (the group, or the group and its padding).
  void InitializeGroup(size_t l, std::optional<uint64_t> seed, std::span<float> values) const;
  // After a failed step: takes back the state the backend returned intact. Returns `error`
  // when everything came back, DataLoss naming what the optimizer had already changed.
  // `graph`'s state objects are state_[index[i]] (index empty: state_[i]).
  Status RecoverState(const Status& error, ValueMap& intact, const StepGraph& graph,
                      const std::vector<size_t>& index);

  ModelSpec model_;
  ModelSpec split_;  // what the step graph runs (model_ without tensor parallelism)
  TrainingPlan plan_;
  std::unique_ptr<OpRegistry> registry_;  // definitions, for planning
  std::unique_ptr<GraphBackend> backend_;
  StepGraph step_graph_;
  int step_handle_ = -1;
  // 0/1 Adam (OptimizerConfig::Kind::kZeroOneAdam): step_graph_ is its sync step's, whose state
  // holds every other kind's; the other kinds' graphs are planned and registered when first
  // run, each with the index into state_ of each of its state objects.
  struct KindStep {
    StepGraph graph;
    int handle = -1;
    std::vector<size_t> state_index;
  };
  std::map<OptimizerConfig::ZeroOneStep, KindStep> zero_one_steps_;
  Result<KindStep*> ZeroOneStepGraph(OptimizerConfig::ZeroOneStep kind);
  std::optional<ZeroOneAdamSchedule> zero_one_;
  float lr_sum_ = 0;  // 0/1 Adam: the learning rates of the local steps since the last sync
  // 0/1 Adam: the interval starts are to be set to the parameters before the next local step.
  bool interval_starts_stale_ = true;
  Status StartIntervalsAtTheParameters();
  // Writes zeros to every state object of `kind` (0/1 Adam's error buffers).
  Status ZeroStateOf(StateKind kind);
  // EvalLoss's and the placed Predict's forward parts of step_graph_, planned and registered
  // when first run (again after the step graph is re-planned).
  struct PlacedForward {
    StepForward forward;
    int handle = -1;
  };
  std::map<ForwardResult, PlacedForward> placed_forwards_;
  Result<const PlacedForward*> PlacedForwardOf(ForwardResult result);
  // Runs the forward part on `batch` (the plan's shape) and the state it reads.
  Result<ValueMap> RunPlaced(const PlacedForward& placed, const std::vector<Tensor>& batch);
  // Predict on the placement: `rows` rows of `batch`, in chunks of the plan's batch.
  Result<Tensor> PredictPlaced(const std::vector<Tensor>& batch, int64_t rows);
  // Rows [first, first + the plan's batch) of each non-label input of `batch` (of `rows` rows),
  // zeros past its last row; label inputs left undefined.
  Result<std::vector<Tensor>> ChunkOfRows(const std::vector<Tensor>& batch, int64_t first,
                                          int64_t rows) const;
  // The axis along which the ranks of a row group split each input of the step (0: none):
  // a spatial split's (ModelInput::split_axis), else a sequence input's positions (1).
  int SplitAxisOf(size_t input) const;
  // Uploads each rank's micro-batch of `batch` to what `targets` (StepGraph::inputs' layout, of
  // `graph` or its forward part) names, skipping invalid ids.
  Status UploadStepInputs(const StepGraph& graph, const std::vector<Tensor>& batch,
                          const std::vector<std::vector<ObjectId>>& targets, ValueMap& inputs);
  // Prediction graphs by batch and seq_len, registered once each.
  struct PlannedForward {
    ForwardGraph graph;
    int handle = -1;
  };
  std::map<std::pair<int64_t, int64_t>, PlannedForward> prediction_graphs_;
  Result<const PlannedForward*> PredictionGraph(int64_t batch, int64_t seq_len);
  // Runs a forward-only graph on `batch` (one tensor per model input; labels skipped when the
  // graph has none) and the full parameters; returns its result.
  Result<Tensor> RunForward(const ForwardGraph& graph, int handle,
                            const std::vector<Tensor>& batch);
  // One task of `op` per state object (WriteState, CopyState): where it runs, and its file.
  struct StateTask {
    WorkerId worker;
    std::string path;  // write_file's attribute
  };
  Result<std::vector<Value>> RunStateTasks(const std::string& op,
                                           const std::vector<size_t>& indices,
                                           const std::vector<StateTask>& tasks);
  // RunStateTasks' graphs, by op, objects, workers and paths: the handle, the input of each
  // state object, and each task's output.
  struct StateTaskGraph {
    int handle = -1;
    std::map<size_t, ObjectId> inputs;
    std::vector<ObjectId> outputs;
  };
  std::map<std::string, StateTaskGraph> state_task_graphs_;

  // Full parameter groups for the forward-only graphs (stage 3 gathers them here).
  Result<std::vector<Value>> FullParameters();
  int64_t ParamMultiple() const;
  // The split model's group `layer` (step_graph_.group_numel elements) of tensor rank t, from
  // or to the state objects of the ranks of that tensor rank (t < 0: every rank).
  Result<std::vector<float>> ReadPlannedGroup(size_t layer, int t, StateKind kind);
  Status WritePlannedGroup(size_t layer, int t, StateKind kind, std::span<const float> values);
  // A whole group from the split model's groups of every tensor rank that `read(planned layer,
  // t)` returns (without tensor parallelism the planned group itself: read(layer, -1)).
  using PlannedGroupReader = std::function<Result<std::vector<float>>(size_t, int)>;
  Result<std::vector<float>> GatherWholeGroup(size_t layer, const PlannedGroupReader& read);
  // The split model's group `layer` of tensor rank t (t < 0: any) assembled from the first
  // `count` objects that piece_of(i) places (nullptr: not one of them), values[i] holding each;
  // NotFound naming `what` ("exp_avg", "gradient") when none does.
  Result<std::vector<float>> AssembleOfTensorRank(
      size_t layer, int t, const char* what, size_t count,
      const std::function<const GroupPiece*(size_t)>& piece_of, const std::vector<Value>& values);
  // Where each slot of the whole model lives in the split one (Create fills it).
  struct SliceOfSlot {
    size_t layer = 0;  // the split model's
    const FlatSlot* slot = nullptr;
    SlotSplit split;
  };
  Status MapSlices();
  // The whole tensor `whole` (shape of the whole slot) -> rank t's slice, or back.
  void CopySlice(const SliceOfSlot& slice, const FlatSlot& whole_slot, int t, const float* from,
                 float* to, bool to_slice) const;
  std::vector<std::vector<SliceOfSlot>> slices_;  // per whole layer, per slot (tensor parallel)

  std::vector<Value> state_;        // parallel to step_graph_.state
  std::vector<Value> last_grads_;   // parallel to step_graph_.grads (SetKeepGradients)
  std::vector<Value> full_params_;  // FullParameters' cache (stage 3), until the next step
  bool keep_gradients_ = false;
  int64_t steps_taken_ = 0;
};

}  // namespace tessera
