// The forward/backward expansion pass: the layer program of the model, per rank and
// micro-batch, as forward and backward tasks (a split backward as its input and weight halves),
// with the sums of gradient parts and the accumulation of each group's gradient over
// micro-batches. The sharding policy says which parameters each task reads and what happens to
// each micro-batch's gradient; nothing here depends on the ZeRO stage.
#include <map>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "ops/standard_ops.h"
#include "planner/model_facts.h"
#include "planner/plan_passes.h"

namespace tessera {

namespace {

using Arg = LayerArg::Kind;

// One micro-batch of one rank while it is expanded. Per layer: the objects its forward read
// (args) and returned (outputs); the first activation it read (entering); the parts of the
// gradient of each of its outputs, one per reading layer (output_grads), and of each group's
// gradient so far (param_grads); the gradient of its output 0 (entering_grad).
struct MicroBatch {
  int r = 0;
  int k = 0;
  size_t index = 0;  // into StepGraph::inputs: r * micro_batches + k
  std::vector<std::vector<ObjectId>> args, outputs;
  std::vector<ObjectId> entering;
  std::vector<std::vector<std::vector<ObjectId>>> output_grads;
  std::vector<std::vector<ObjectId>> param_grads;
  std::vector<ObjectId> entering_grad;
  // Per layer: the copies one tier down of what its forward saves, by output index (a swapped
  // layer).
  std::vector<std::map<int, ObjectId>> swapped;
  // Ring attention: blocks re-derived for the backwards, per origin (layer, output) and number of
  // forward rotations (Expansion::RotatedBack).
  std::map<std::pair<size_t, int>, std::map<int, ObjectId>> rotated_back;
};

// A backward's arguments, and which of them each half of a split backward reads.
struct BackwardReads {
  std::vector<ObjectId> whole, input_half, weight_half;
};

// A backward's outputs (in backward_outputs' order): names, roles, and which are input
// gradients (the rest are parameter gradients).
struct BackwardOutputs {
  std::vector<std::string> names;
  std::vector<ObjectRole> roles;
  std::vector<bool> is_input;
};

class Expansion {
 public:
  explicit Expansion(PlanState& state) : s_(state), readers_(state.num_layers) {
    const ParallelConfig& p = state.parallel;
    const bool zero_bubble =
        SplitsBackward(p.schedule) && (state.num_stages > 1 || p.virtual_stages > 1);
    for (size_t l = 0; l < state.num_layers; ++l) {
      const LayerSpec& layer = state.model.layers[l];
      layer_attrs_.push_back(LayerAttrs(layer, state.sharding->GroupMultiple()));
      const bool whole = l < state.activation_choices.size() &&
                         state.activation_choices[l].whole_backward;  // the memory plan's
      split_.push_back((zero_bubble || p.split_backwards) && !whole &&
                       SplitsLayerBackward(state.model, l));
      for (const LayerArg& arg : layer.forward_args) {
        if (arg.kind == Arg::kParams) readers_[arg.index].push_back(l);
      }
    }
    // The forward outputs only their own layer's backward reads (what a layer saves).
    saved_only_.resize(state.num_layers);
    for (size_t l = 0; l < state.num_layers; ++l) {
      for (const BackwardArg& arg : state.model.layers[l].backward_args) {
        if (arg.kind == BackwardArg::Kind::kForwardOutput) saved_only_[l].insert(arg.index);
      }
    }
    for (const LayerSpec& layer : state.model.layers) {
      for (const LayerArg& arg : layer.forward_args) {
        if (arg.kind == Arg::kActivation) saved_only_[arg.index].erase(arg.output);
      }
    }
  }

  Status Run() {
    for (int r = 0; r < s_.num_ranks; ++r) {
      for (int k = 0; k < s_.num_micro_batches; ++k) {
        MicroBatch mb;
        mb.r = r;
        mb.k = k;
        mb.index = static_cast<size_t>(r) * static_cast<size_t>(s_.num_micro_batches) +
                   static_cast<size_t>(k);
        const size_t layers = s_.num_layers;
        mb.args.resize(layers);
        mb.outputs.resize(layers);
        mb.swapped.resize(layers);
        mb.entering.resize(layers);
        for (size_t l = 0; l < layers; ++l) TESSERA_RETURN_IF_ERROR(AddForward(mb, l));
        if (s_.serialize_micro_batches && k > 0) TESSERA_RETURN_IF_ERROR(AfterPrevious(mb));
        mb.output_grads.resize(layers);
        for (size_t l = 0; l < layers; ++l) {
          mb.output_grads[l].resize(static_cast<size_t>(s_.model.layers[l].activations));
        }
        mb.param_grads.resize(layers);
        mb.entering_grad.resize(layers);
        for (size_t l = layers; l-- > 0;) TESSERA_RETURN_IF_ERROR(AddBackward(mb, l));
        TESSERA_RETURN_IF_ERROR(FlushBucket(mb));
      }
    }
    return Status::Ok();
  }

 private:
  RankState& Rank(const MicroBatch& mb) { return s_.ranks[static_cast<size_t>(mb.r)]; }
  std::string TaskName(const MicroBatch& mb, size_t l, const char* what) const {
    return s_.Name(mb.r, s_.Micro(mb.k, s_.LayerName(l) + "/" + what));
  }
  std::string ObjectName(const MicroBatch& mb, const std::string& name) const {
    return s_.Name(mb.r, s_.Micro(mb.k, name));
  }
  size_t Prefetch() const { return static_cast<size_t>(s_.parallel.prefetch_layers); }

  // PlanState::serialize_micro_batches: micro-batch k's forwards start once micro-batch k-1's
  // backwards are done (its first forward after each of those).
  Status AfterPrevious(const MicroBatch& mb) {
    const RankState& rank = Rank(mb);
    const auto previous = static_cast<size_t>(mb.k - 1);
    const TaskId first = rank.forward_task[0][static_cast<size_t>(mb.k)];
    for (size_t l = 0; l < s_.num_layers; ++l) {
      const TaskId backward = rank.backward_task[l][previous];
      if (backward.valid()) s_.builder.AddControlEdge(backward, first);
    }
    return Status::Ok();
  }

  // The layer's attributes; the loss layer's carry grad_scale (1 / (ranks x micro-batches): the
  // loss is a mean over every rank's micro-batches).
  Attrs AttrsOf(const MicroBatch& mb, size_t l) const {
    Attrs attrs = layer_attrs_[l];
    // A split layer's tasks carry their tensor rank, which the layer program hands to its ops.
    if (s_.tensor_parallel > 1 && s_.model.layers[l].tensor_parallel) {
      attrs.Set(kTensorRankAttr, int64_t{s_.TensorRank(mb.r)});
    }
    // Under sequence parallelism every layer's tasks carry their sequence rank (the positions
    // they hold).
    if (s_.parallel.sequence_parallel > 1) {
      attrs.Set(kSequenceRankAttr, int64_t{s_.parallel.SequenceRankOf(mb.r)});
    }
    // Under Megatron-LM's sequence parallelism a layer on 1/T of the positions holds its tensor
    // rank's part.
    const auto& tp = s_.model.layers[l].tensor_parallel;
    if (s_.tensor_parallel > 1 && tp && tp->sequence_sharded) {
      attrs.Set(kSequenceRankAttr, int64_t{s_.TensorRank(mb.r)});
    }
    const int splits = s_.num_data_ranks * s_.num_micro_batches;
    if (s_.model.layers[l].loss && splits > 1) {
      attrs.Set("grad_scale", 1.0 / static_cast<double>(splits));
    }
    // Kept in part (or recomputed or swapped keeping part): the forward (and the recompute) saves
    // less, and the backward rebuilds the rest (the op's attribute "rebuild",
    // OpDef::rebuild_options); swapped, only what it saves goes down and back.
    if (l < s_.activation_choices.size() && !s_.activation_choices[l].rebuild.empty() &&
        s_.activation_choices[l].choice != ActivationChoice::kKeep) {
      attrs.Set(kRebuildAttr, s_.activation_choices[l].rebuild);
    }
    return attrs;
  }

  // StepGraph::predictions: what the loss layer l reads first (its arguments are in
  // forward_args' order), for this micro-batch.
  void RecordPrediction(const MicroBatch& mb, size_t l) {
    const LayerSpec& loss = s_.model.layers[l];
    for (size_t i = 0; i < loss.forward_args.size(); ++i) {
      if (loss.forward_args[i].kind != Arg::kActivation) continue;
      std::vector<ObjectId>& predictions = s_.step.predictions;
      predictions.resize(static_cast<size_t>(s_.num_ranks) *
                         static_cast<size_t>(s_.num_micro_batches));
      predictions[mb.index] = mb.args[l][i];
      return;
    }
  }

  Status AddForward(MicroBatch& mb, size_t l) {
    const LayerSpec& layer = s_.model.layers[l];
    for (const LayerArg& arg : layer.forward_args) {
      if (arg.kind == Arg::kActivation) {
        mb.entering[l] = mb.outputs[arg.index][static_cast<size_t>(arg.output)];
        break;
      }
    }
    // ZeRO-3 gathers wait for the activation entering the layer `prefetch` back, so at most
    // that many layers' parameters are gathered ahead of use.
    const ObjectId after = l >= Prefetch() + 1 ? mb.entering[l - Prefetch()] : ObjectId();
    for (const LayerArg& arg : layer.forward_args) {
      switch (arg.kind) {
        case Arg::kModelInput:
          mb.args[l].push_back(s_.step.inputs[arg.index][mb.index]);
          break;
        case Arg::kActivation:
          mb.args[l].push_back(mb.outputs[arg.index][static_cast<size_t>(arg.output)]);
          break;
        case Arg::kParams: {
          const ParamUse use{mb.r, mb.k, l, arg.index, /*backward=*/false, after};
          TESSERA_ASSIGN_OR_RETURN(ObjectId params, s_.sharding->ForwardParams(s_, use));
          mb.args[l].push_back(params);
          break;
        }
      }
    }
    std::vector<std::string> names;
    std::vector<ObjectRole> roles;
    if (layer.loss) {
      names = {
          ObjectName(mb, s_.num_data_ranks * s_.num_micro_batches > 1 ? "micro_loss" : "loss")};
      roles = {ObjectRole::kOutput};
    }
    TESSERA_ASSIGN_OR_RETURN(
        mb.outputs[l],
        s_.builder.AddTask(
            TaskName(mb, l, "forward"), layer.forward_op, mb.args[l], AttrsOf(mb, l),
            s_.On(mb.r, layer.name, kForwardPriority, std::move(names), std::move(roles))));
    const TaskId forward = s_.ProducerOf(mb.outputs[l][0]);
    Rank(mb).forward_task[l][static_cast<size_t>(mb.k)] = forward;
    if (layer.loss) {
      Rank(mb).losses.push_back(mb.outputs[l][0]);
      RecordPrediction(mb, l);
    }
    TESSERA_RETURN_IF_ERROR(SumPartialOutputs(mb, l));
    TESSERA_RETURN_IF_ERROR(ExchangeOutputs(mb, l));
    // A swap out overlaps the next layer's forward, and is done before the one after starts
    // (what the solver and the memory model count: a slow copy holds the forwards back, rather
    // than the saved objects of layer after layer waiting in memory for it).
    if (l >= 2 && s_.StageOf(l - 2) == s_.StageOf(l)) {
      for (const auto& [o, copy] : mb.swapped[l - 2]) {
        s_.builder.AddControlEdge(s_.ProducerOf(copy), forward);
      }
    }
    if (Swaps(l)) return AddSwapOut(mb, l);
    return Status::Ok();
  }

  // Rank r's member of collective `op` on an activation of layer l ("<layer>/<what>", its result
  // the activation "<layer>.<what>"); `members(name, r)` gives the member's attributes.
  Result<ObjectId> ActivationCollective(const MicroBatch& mb, size_t l, const std::string& what,
                                        const char* op, ObjectId value, int32_t priority,
                                        Attrs (PlanState::*members)(const std::string&, int),
                                        const Attrs& extra,
                                        ObjectRole role = ObjectRole::kActivation) {
    const std::string& layer = s_.LayerName(l);
    const std::string name = s_.Micro(mb.k, layer + "/" + what);
    Attrs attrs = (s_.*members)(name, mb.r);
    for (const auto& [key, setting] : extra.values()) attrs.Set(key, setting);
    TESSERA_ASSIGN_OR_RETURN(
        auto result, s_.builder.AddTask(s_.Name(mb.r, name), op, {value}, std::move(attrs),
                                        s_.On(mb.r, layer, priority,
                                              {ObjectName(mb, layer + "." + what)}, {role})));
    return result[0];
  }

  // Tensor parallelism: an all-reduce over the tensor ranks of `part`, rank r's partial sum (on
  // the tensor channel); returns the sum.
  Result<ObjectId> SumOverTensorRanks(const MicroBatch& mb, size_t l, const std::string& what,
                                      ObjectId part, int32_t priority,
                                      ObjectRole role = ObjectRole::kActivation) {
    return ActivationCollective(mb, l, what, "all_reduce", part, priority,
                                &PlanState::TensorCollective, Attrs{{"reduce", std::string("sum")}},
                                role);
  }

  // Megatron-LM's sequence parallelism: `value` reduce-scattered (its sum's 1/T of the positions
  // this rank holds) or all-gathered (every rank's 1/T joined) along the sequence over the
  // tensor ranks (core/exchange_layout.h's kSequenceLayout).
  Result<ObjectId> SplitSequenceOverTensorRanks(const MicroBatch& mb, size_t l,
                                                const std::string& what, ObjectId value,
                                                bool gather, int32_t priority) {
    Attrs extra{{kLayoutAttr, std::string(kSequenceLayout)}};
    if (!gather) extra.Set("reduce", std::string("sum"));
    return ActivationCollective(mb, l, what, gather ? "all_gather" : "reduce_scatter", value,
                                priority, &PlanState::TensorCollective, extra);
  }

  // The layer's partial outputs (TensorParallelLayer::partial_outputs) summed over the tensor
  // ranks: what every reader reads (reduce-scattered along the sequence where the layer says so;
  // all-reduced otherwise), and its gathered outputs all-gathered. A sum's gradient needs
  // nothing (its backward passes the gradient on as it is); the sequence splits' go back by
  // their adjoints (AddBackward).
  Status SumPartialOutputs(MicroBatch& mb, size_t l) {
    const LayerSpec& layer = s_.model.layers[l];
    if (s_.tensor_parallel == 1 || !layer.tensor_parallel) return Status::Ok();
    const TensorParallelLayer& tp = *layer.tensor_parallel;
    for (size_t o = 0; o < tp.partial_outputs.size(); ++o) {
      ObjectId& output = mb.outputs[l][o];
      // ModelSpec::Validate refused a partial or gathered output kept for the backward.
      if (tp.scatters(o)) {
        TESSERA_ASSIGN_OR_RETURN(
            output, SplitSequenceOverTensorRanks(mb, l, fmt::format("tp_scatter{}", o), output,
                                                 /*gather=*/false, kForwardPriority + 1));
      } else if (tp.partial_outputs[o]) {
        TESSERA_ASSIGN_OR_RETURN(output, SumOverTensorRanks(mb, l, fmt::format("tp_sum{}", o),
                                                            output, kForwardPriority + 1));
      } else if (tp.gathers(o)) {
        TESSERA_ASSIGN_OR_RETURN(
            output, SplitSequenceOverTensorRanks(mb, l, fmt::format("tp_gather{}", o), output,
                                                 /*gather=*/true, kForwardPriority + 1));
      }
    }
    return Status::Ok();
  }

  // Sequence parallelism: `value` after an all-to-all over rank r's sequence ranks in `layout`
  // (on the activations' channel): block j of every rank's value to rank j.
  Result<ObjectId> ExchangeOverSequenceRanks(const MicroBatch& mb, size_t l,
                                             const std::string& what, ObjectId value,
                                             ExchangeLayout layout, int32_t priority) {
    return ActivationCollective(mb, l, what, "all_to_all", value, priority,
                                &PlanState::SequenceCollective,
                                Attrs{{kLayoutAttr, std::string(ExchangeLayoutName(layout))}});
  }

  // The layer's exchanged outputs (LayerSpec::exchanged_outputs), what every reader reads.
  Status ExchangeOutputs(MicroBatch& mb, size_t l) {
    const std::vector<ExchangeLayout>& exchanged = s_.model.layers[l].exchanged_outputs;
    for (size_t o = 0; o < exchanged.size(); ++o) {
      // ModelSpec::Validate refused an exchanged output kept for the backward.
      if (exchanged[o] == ExchangeLayout::kNone) continue;
      TESSERA_ASSIGN_OR_RETURN(
          mb.outputs[l][o],
          ExchangeOverSequenceRanks(mb, l, fmt::format("exchange{}", o), mb.outputs[l][o],
                                    exchanged[o], kForwardPriority + 1));
    }
    return Status::Ok();
  }

  // Backward output j of layer l, the gradient of an activation the layer declares partial
  // (TensorParallelLayer::partial_input_gradients), summed over the tensor ranks; the gradient of
  // an all-gathered value is summed (and scattered) by the gather's adjoint instead.
  Result<ObjectId> InputGradient(const MicroBatch& mb, size_t l, size_t j, ObjectId grad) {
    const LayerSpec& layer = s_.model.layers[l];
    const size_t arg = layer.backward_outputs[j];
    if (s_.tensor_parallel == 1 || !layer.tensor_parallel ||
        !layer.tensor_parallel->partial_input_gradients[arg]) {
      return grad;
    }
    if (s_.model.ReadsGathered(layer, arg)) return grad;
    return SumOverTensorRanks(mb, l, fmt::format("tp_sum_dx{}", arg), grad, kBackwardPriority + 1);
  }

  // The gradient of layer l's parameters: a layer on 1/T of the positions (Megatron-LM's
  // sequence parallelism; its slots all replicated) makes a partial sum, summed over the tensor
  // ranks before it joins the group's.
  Result<ObjectId> ParamGradient(const MicroBatch& mb, size_t l, size_t group, ObjectId grad) {
    const auto& tp = s_.model.layers[l].tensor_parallel;
    if (s_.tensor_parallel == 1 || !tp || !tp->sequence_sharded) return grad;
    return SumOverTensorRanks(mb, l, fmt::format("tp_sum_dparams{}", group), grad,
                              kBackwardPriority + 1, ObjectRole::kGradient);
  }

  bool Swaps(size_t l) const {
    return l < s_.activation_choices.size() &&
           s_.activation_choices[l].choice == ActivationChoice::kSwap && !s_.model.layers[l].loss;
  }

  // A swapped layer: what its forward saves copied to the next tier down as soon as it is made
  // ("<layer>/swap_out", a copy task on the host: a GPU worker's to the host, a CPU worker's to
  // its swap file on the disk); the object it copied, read by no one else, is then freed.
  Status AddSwapOut(MicroBatch& mb, size_t l) {
    const std::string& layer = s_.LayerName(l);
    const bool to_disk = s_.plan.device.is_cpu();
    for (int o : saved_only_[l]) {
      const ObjectId saved = mb.outputs[l][static_cast<size_t>(o)];
      TaskOptions options =
          s_.On(mb.r, layer, kForwardPriority + 1,
                {s_.builder.graph().object(saved).name + (to_disk ? ".disk" : ".host")},
                {ObjectRole::kActivation});
      options.device_kind = DeviceKind::kCpu;
      options.outputs_on_disk = to_disk;
      TESSERA_ASSIGN_OR_RETURN(
          auto host, s_.builder.AddTask(TaskName(mb, l, fmt::format("swap_out{}", o).c_str()),
                                        "copy", {saved}, {}, std::move(options)));
      mb.swapped[l][o] = host[0];
    }
    return Status::Ok();
  }

  // Its copy back ("<layer>/swap_in"), prefetched one layer ahead: after the task
  // that lets the next layer's backward start (the gradient entering it; the loss's forward
  // for the layer below the loss), so it runs while that backward does.
  Result<ObjectId> AddSwapIn(MicroBatch& mb, size_t l, int o, ObjectId host) {
    const std::string& layer = s_.LayerName(l);
    const size_t loss_layer = s_.num_layers - 1;
    TESSERA_ASSIGN_OR_RETURN(
        auto device,
        s_.builder.AddTask(TaskName(mb, l, fmt::format("swap_in{}", o).c_str()), "copy", {host}, {},
                           s_.On(mb.r, layer, kBackwardPriority + 1,
                                 {ObjectName(mb, fmt::format("{}/swapped_in{}", layer, o))},
                                 {ObjectRole::kActivation})));
    const ObjectId lead =
        l + 1 == loss_layer ? mb.outputs[loss_layer].back() : mb.entering_grad[l + 1];
    if (l + 1 <= loss_layer && lead.valid()) {
      s_.builder.AddControlEdge(s_.ProducerOf(lead), s_.ProducerOf(device[0]));
    }
    return device[0];
  }

  Status AddBackward(MicroBatch& mb, size_t l) {
    const LayerSpec& layer = s_.model.layers[l];
    const size_t loss_layer = s_.num_layers - 1;
    // The gradient of each output: its parts summed (none for the loss).
    std::vector<ObjectId> dy(mb.output_grads[l].size());
    if (!layer.loss) {
      for (size_t o = 0; o < dy.size(); ++o) {
        TESSERA_ASSIGN_OR_RETURN(
            dy[o], s_.Sum(mb.r, s_.StageOf(l), ObjectName(mb, fmt::format("{}.d{}", layer.name, o)),
                          mb.output_grads[l][o]));
        // An exchanged output's gradient goes back by the adjoint all-to-all; a scattered
        // one's by an all-gather, a gathered one's (its readers' partial sums) by a
        // reduce-scatter.
        if (layer.exchanges(o) && dy[o].valid()) {
          TESSERA_ASSIGN_OR_RETURN(
              dy[o], ExchangeOverSequenceRanks(mb, l, fmt::format("exchange_d{}", o), dy[o],
                                               AdjointExchange(layer.exchanged_outputs[o]),
                                               kBackwardPriority + 1));
        }
        const auto& tp = layer.tensor_parallel;
        if (s_.tensor_parallel > 1 && tp && (tp->scatters(o) || tp->gathers(o)) && dy[o].valid()) {
          const bool gather = tp->scatters(o);
          TESSERA_ASSIGN_OR_RETURN(
              dy[o], SplitSequenceOverTensorRanks(
                         mb, l, fmt::format("{}{}", gather ? "tp_gather_d" : "tp_scatter_d", o),
                         dy[o], gather, kBackwardPriority + 1));
        }
      }
      if (!dy.empty()) mb.entering_grad[l] = dy[0];
    }
    ObjectId after = mb.outputs[loss_layer].back();
    if (l + Prefetch() < loss_layer) after = mb.entering_grad[l + Prefetch()];
    TESSERA_ASSIGN_OR_RETURN(BackwardReads reads, ReadsOfBackward(mb, l, dy, after));
    BackwardOutputs outputs = OutputsOfBackward(mb, l);
    std::vector<ObjectId> grads;  // in backward_outputs' order
    if (split_[l]) {
      TESSERA_ASSIGN_OR_RETURN(grads, AddSplitBackward(mb, l, std::move(reads), outputs));
    } else {
      TESSERA_ASSIGN_OR_RETURN(
          grads, s_.builder.AddTask(TaskName(mb, l, "backward"), layer.backward_op,
                                    std::move(reads.whole), AttrsOf(mb, l),
                                    s_.On(mb.r, layer.name, kBackwardPriority,
                                          std::move(outputs.names), std::move(outputs.roles))));
      if (!grads.empty()) {
        Rank(mb).backward_task[l][static_cast<size_t>(mb.k)] = s_.ProducerOf(grads[0]);
      }
    }
    for (size_t j = 0; j < grads.size() && j < layer.backward_outputs.size(); ++j) {
      const LayerArg& forward = layer.forward_args[layer.backward_outputs[j]];
      if (forward.kind == Arg::kActivation) {
        TESSERA_ASSIGN_OR_RETURN(ObjectId dx, InputGradient(mb, l, j, grads[j]));
        mb.output_grads[forward.index][static_cast<size_t>(forward.output)].push_back(dx);
      } else {
        TESSERA_ASSIGN_OR_RETURN(ObjectId dparams, ParamGradient(mb, l, forward.index, grads[j]));
        mb.param_grads[forward.index].push_back(dparams);
      }
    }
    return CompleteGroups(mb, l);
  }

  // What layer l's backward reads, in backward_args' order. When the memory plan recomputes
  // the layer (PlanState::activation_choices), what its forward returned is read from a
  // recompute of the forward instead (AddRecompute).
  Result<BackwardReads> ReadsOfBackward(MicroBatch& mb, size_t l, const std::vector<ObjectId>& dy,
                                        ObjectId after) {
    const LayerSpec& layer = s_.model.layers[l];
    // The layer's parameters as the backward reads them, per forward argument (asked for once).
    std::map<size_t, ObjectId> backward_params;
    auto params_of = [&](size_t index) -> Result<ObjectId> {
      auto it = backward_params.find(index);
      if (it != backward_params.end()) return it->second;
      const LayerArg& forward = layer.forward_args[index];
      ObjectId read = mb.args[l][index];
      // The loss layer's backward follows its forward at once: it reads what that read.
      if (!layer.loss) {
        const ParamUse use{mb.r, mb.k, l, forward.index, /*backward=*/true, after};
        TESSERA_ASSIGN_OR_RETURN(read, s_.sharding->BackwardParams(s_, use, read));
      }
      backward_params.emplace(index, read);
      return read;
    };
    std::vector<ObjectId> recomputed;  // the forward's outputs again, when recomputed
    BackwardReads reads;
    for (const BackwardArg& arg : layer.backward_args) {
      ObjectId read;
      switch (arg.kind) {
        case BackwardArg::Kind::kOutputGradient:
          if (!dy[arg.index].valid()) {
            return InvalidArgument(
                "output {} of layer '{}' is read by no layer, so it has no gradient: read it "
                "or drop it",
                arg.index, layer.name);
          }
          read = dy[arg.index];
          break;
        case BackwardArg::Kind::kForwardArg: {
          const LayerArg& forward = layer.forward_args[arg.index];
          TESSERA_ASSIGN_OR_RETURN(read,
                                   ForwardArgAgain(mb, l, static_cast<size_t>(arg.index), dy));
          if (forward.kind == Arg::kParams) {
            TESSERA_ASSIGN_OR_RETURN(read, params_of(static_cast<size_t>(arg.index)));
          }
          break;
        }
        case BackwardArg::Kind::kForwardOutput:
          read = mb.outputs[l][arg.index];
          if (Recomputes(l)) {
            if (recomputed.empty()) {
              std::vector<ObjectId> args = mb.args[l];
              for (size_t i = 0; i < args.size(); ++i) {
                if (layer.forward_args[i].kind == Arg::kParams) {
                  TESSERA_ASSIGN_OR_RETURN(args[i], params_of(i));
                } else {
                  TESSERA_ASSIGN_OR_RETURN(args[i], ForwardArgAgain(mb, l, i, dy));
                }
              }
              TESSERA_ASSIGN_OR_RETURN(recomputed, AddRecompute(mb, l, std::move(args), dy));
            }
            read = recomputed[static_cast<size_t>(arg.index)];
          } else if (auto it = mb.swapped[l].find(arg.index); it != mb.swapped[l].end()) {
            TESSERA_ASSIGN_OR_RETURN(read, AddSwapIn(mb, l, arg.index, it->second));
          }
          break;
        case BackwardArg::Kind::kGradientSoFar: {
          const size_t group = layer.forward_args[arg.index].index;
          if (mb.param_grads[group].empty()) {
            return InvalidArgument(
                "layer '{}' adds to the gradient of '{}', but no layer after it made one",
                layer.name, s_.LayerName(group));
          }
          TESSERA_ASSIGN_OR_RETURN(read, s_.Sum(mb.r, s_.StageOf(group),
                                                ObjectName(mb, s_.LayerName(group) + ".grad_parts"),
                                                mb.param_grads[group]));
          mb.param_grads[group].clear();
          break;
        }
      }
      reads.whole.push_back(read);
      if (arg.kind != BackwardArg::Kind::kGradientSoFar) reads.input_half.push_back(read);
      if (arg.kind != BackwardArg::Kind::kOutputGradient) reads.weight_half.push_back(read);
    }
    return reads;
  }

  // Forward argument `arg` of layer l as its backward (or its recompute) reads it: what the
  // forward read, but for a rotated block of ring attention whose rotations started on the same
  // stage, which is re-derived from the rank's own block (RotatedBack) so that the forward's
  // rotated copies are freed after their forward readers.
  Result<ObjectId> ForwardArgAgain(MicroBatch& mb, size_t l, size_t arg,
                                   const std::vector<ObjectId>& dy) {
    const ObjectId read = mb.args[l][arg];
    const std::optional<ModelSpec::Rotated> rotated = s_.model.RotationOrigin(l, arg);
    if (!rotated.has_value() || s_.StageOf(rotated->origin_layer) != s_.StageOf(l) ||
        rotated->rotations >= s_.parallel.sequence_parallel) {
      return read;
    }
    return RotatedBack(mb, *rotated, dy);
  }

  // The block `rotated` names (the rank's own block after k forward rotations: rank r - k's),
  // re-derived for the backward by rotating the rank's own block the other way (kRingPrevious)
  // P - k times: P - 1 rotations back first (rank r + 1's block), then each one further. The
  // backwards read them in that order, each made after the gradients entering its reader's
  // backward exist, so about two blocks are live at a time, not P ("<origin>/rotate_back<o>_<k>").
  Result<ObjectId> RotatedBack(MicroBatch& mb, const ModelSpec::Rotated& rotated,
                               const std::vector<ObjectId>& dy) {
    std::map<int, ObjectId>& chain = mb.rotated_back[{rotated.origin_layer, rotated.origin_output}];
    if (auto it = chain.find(rotated.rotations); it != chain.end()) return it->second;
    const int ranks = s_.parallel.sequence_parallel;
    ObjectId source;
    if (rotated.rotations + 1 == ranks) {  // the rank's own block, as its layer made it
      source = mb.outputs[rotated.origin_layer][static_cast<size_t>(rotated.origin_output)];
    } else {
      ModelSpec::Rotated further = rotated;
      ++further.rotations;
      TESSERA_ASSIGN_OR_RETURN(source, RotatedBack(mb, further, {}));
    }
    TESSERA_ASSIGN_OR_RETURN(
        ObjectId block,
        ExchangeOverSequenceRanks(
            mb, rotated.origin_layer,
            fmt::format("rotate_back{}_{}", rotated.origin_output, rotated.rotations), source,
            ExchangeLayout::kRingPrevious, kBackwardPriority + 1));
    AfterEnteringGradients(s_.ProducerOf(block), dy);
    chain.emplace(rotated.rotations, block);
    return block;
  }

  // `task` (work for a backward, done just before it) waits for the gradients `dy` entering that
  // backward, so it does not run early and hold what the plan freed. A gradient from another
  // worker (a pipeline's next stage) cannot order it: the stage's schedule does
  // (OrderSchedulePass chains a recompute just before its backward).
  void AfterEnteringGradients(TaskId task, const std::vector<ObjectId>& dy) {
    const Graph& graph = s_.builder.graph();
    for (ObjectId gradient : dy) {
      if (!gradient.valid()) continue;
      const TaskId producer = s_.ProducerOf(gradient);
      if (graph.task(producer).pinned_worker == graph.task(task).pinned_worker) {
        s_.builder.AddControlEdge(producer, task);
      }
    }
  }

  bool Recomputes(size_t l) const {
    return l < s_.activation_choices.size() &&
           s_.activation_choices[l].choice == ActivationChoice::kRecompute &&
           !s_.model.layers[l].loss;
  }

  // Layer l's forward again ("<layer>/recompute"), on the same arguments (its parameters as the
  // backward reads them), just before its backward: after the tasks that make the gradients
  // entering the backward, so it does not run early and hold what the plan freed. What the
  // forward returned is then read by no one and freed as soon as it is made.
  Result<std::vector<ObjectId>> AddRecompute(MicroBatch& mb, size_t l, std::vector<ObjectId> args,
                                             const std::vector<ObjectId>& dy) {
    const LayerSpec& layer = s_.model.layers[l];
    TESSERA_ASSIGN_OR_RETURN(
        std::vector<ObjectId> outputs,
        s_.builder.AddTask(TaskName(mb, l, "recompute"), layer.forward_op, std::move(args),
                           AttrsOf(mb, l), s_.On(mb.r, layer.name, kBackwardPriority)));
    const TaskId recompute = s_.ProducerOf(outputs[0]);
    Rank(mb).recompute_task[l][static_cast<size_t>(mb.k)] = recompute;
    AfterEnteringGradients(recompute, dy);
    return outputs;
  }

  BackwardOutputs OutputsOfBackward(const MicroBatch& mb, size_t l) const {
    const LayerSpec& layer = s_.model.layers[l];
    BackwardOutputs outputs;
    int dx = 0;
    for (size_t target : layer.backward_outputs) {
      const LayerArg& forward = layer.forward_args[target];
      const bool input = forward.kind == Arg::kActivation;
      outputs.is_input.push_back(input);
      if (input) {
        outputs.names.push_back(
            ObjectName(mb, layer.name + "/backward:dx" + (dx > 0 ? std::to_string(dx) : "")));
        outputs.roles.push_back(ObjectRole::kActivation);
        ++dx;
      } else {
        outputs.names.push_back(ObjectName(
            mb, forward.index == l ? layer.name + ".grad"
                                   : s_.LayerName(forward.index) + ".grad_from_" + layer.name));
        outputs.roles.push_back(s_.sharding->FullGradientRole());
      }
    }
    return outputs;
  }

  // The backward as two tasks: the input half returns the input gradients and a stash; the
  // weight half, reading the stash first, the parameter gradients. Returns the gradients in
  // backward_outputs' order.
  Result<std::vector<ObjectId>> AddSplitBackward(MicroBatch& mb, size_t l, BackwardReads reads,
                                                 const BackwardOutputs& outputs) {
    const LayerSpec& layer = s_.model.layers[l];
    std::vector<std::string> half_names[2];
    std::vector<ObjectRole> half_roles[2];
    for (size_t j = 0; j < outputs.names.size(); ++j) {
      half_names[outputs.is_input[j] ? 0 : 1].push_back(outputs.names[j]);
      half_roles[outputs.is_input[j] ? 0 : 1].push_back(outputs.roles[j]);
    }
    const size_t input_grads = half_names[0].size();
    half_names[0].push_back(ObjectName(mb, layer.name + "/backward_input:stash"));
    half_roles[0].push_back(ObjectRole::kActivation);
    TESSERA_ASSIGN_OR_RETURN(
        auto b, s_.builder.AddTask(TaskName(mb, l, "backward_input"), layer.backward_input_op,
                                   std::move(reads.input_half), AttrsOf(mb, l),
                                   s_.On(mb.r, layer.name, kBackwardPriority,
                                         std::move(half_names[0]), std::move(half_roles[0]))));
    reads.weight_half.insert(reads.weight_half.begin(), b.back());
    const size_t param_grads = half_names[1].size();
    TESSERA_ASSIGN_OR_RETURN(
        auto w, s_.builder.AddTask(TaskName(mb, l, "backward_weight"), layer.backward_weight_op,
                                   std::move(reads.weight_half), AttrsOf(mb, l),
                                   s_.On(mb.r, layer.name, kBackwardPriority,
                                         std::move(half_names[1]), std::move(half_roles[1]))));
    if (b.size() != input_grads + 1 || w.size() != param_grads) {
      return InvalidArgument(
          "layer '{}': ops '{}' and '{}' return {} and {} outputs, but the layer's backward "
          "has {} input gradient(s) (and a stash) and {} parameter gradient(s)",
          layer.name, layer.backward_input_op, layer.backward_weight_op, b.size(), w.size(),
          input_grads, param_grads);
    }
    RankState& rank = Rank(mb);
    rank.backward_task[l][static_cast<size_t>(mb.k)] = s_.ProducerOf(b[0]);
    if (!w.empty()) rank.weight_task[l][static_cast<size_t>(mb.k)] = s_.ProducerOf(w[0]);
    std::vector<ObjectId> grads;
    grads.reserve(outputs.is_input.size());
    size_t next_input = 0, next_param = 0;
    for (bool input : outputs.is_input) grads.push_back(input ? b[next_input++] : w[next_param++]);
    return grads;
  }

  // Groups whose first reader is layer l have every part of their gradient once its backward
  // is done: sum the parts and hand the gradient on.
  Status CompleteGroups(MicroBatch& mb, size_t l) {
    for (size_t group = 0; group < s_.num_layers; ++group) {
      if (readers_[group].empty() || readers_[group].front() != l) continue;
      TESSERA_ASSIGN_OR_RETURN(
          ObjectId full,
          s_.Sum(mb.r, s_.StageOf(group), ObjectName(mb, s_.LayerName(group) + ".grad_parts"),
                 mb.param_grads[group]));
      if (!full.valid()) {
        return InvalidArgument("no layer's backward returns a gradient of the parameters of '{}'",
                               s_.LayerName(group));
      }
      TESSERA_RETURN_IF_ERROR(AddToBucket(mb, group, full));
      s_.last_gradient[static_cast<size_t>(s_.StageOf(group))] = group;
    }
    return Status::Ok();
  }

  // Micro-batch k's full gradient of a group joins the bucket of gradients to reduce together
  // (StepGraph::buckets): the bucket is reduced once it holds the bucket size, before a group of
  // another stage joins, and at the end of the micro-batch's backward.
  Status AddToBucket(const MicroBatch& mb, size_t group, ObjectId full) {
    if (!bucket_.empty() && s_.StageOf(group) != s_.StageOf(bucket_.front())) {
      TESSERA_RETURN_IF_ERROR(FlushBucket(mb));
    }
    bucket_.push_back(group);
    bucket_fulls_.push_back(full);
    bucket_filled_ += s_.builder.graph().object(full).meta.bytes();
    if (bucket_filled_ >= s_.step.buckets.bytes) return FlushBucket(mb);
    return Status::Ok();
  }

  // The bucket's gradients reduced as the sharding policy says, each accumulated in place over
  // the micro-batches, and reduced again after the last one if the policy says so.
  Status FlushBucket(const MicroBatch& mb) {
    if (bucket_.empty()) return Status::Ok();
    const std::vector<size_t> groups = std::exchange(bucket_, {});
    const std::vector<ObjectId> fulls = std::exchange(bucket_fulls_, {});
    bucket_filled_ = 0;
    const int r = mb.r, k = mb.k;
    RankState& rank = Rank(mb);
    TESSERA_ASSIGN_OR_RETURN(std::vector<ObjectId> grads,
                             s_.sharding->ReduceMicroBatchGradients(s_, r, k, groups, fulls));
    for (size_t i = 0; i < groups.size(); ++i) {
      const size_t l = groups[i];
      if (k > 0) {
        const std::string& layer = s_.LayerName(l);
        TESSERA_ASSIGN_OR_RETURN(
            auto sum, s_.builder.AddTask(s_.Name(r, s_.Micro(k, layer + "/accumulate")),
                                         "accumulate", {rank.grad[l], grads[i]}, {},
                                         s_.On(r, layer, kBackwardPriority,
                                               {s_.Name(r, s_.Micro(k, layer + ".grad_sum"))},
                                               {ObjectRole::kGradient})));
        grads[i] = sum[0];
      }
      rank.grad[l] = grads[i];
    }
    if (k + 1 < s_.num_micro_batches) return Status::Ok();
    // 1-bit Adam's compressed phase and 0/1 Adam's non-variance steps: each rank's momentum,
    // gradient or updates are averaged compressed instead, or not at all (optimizer pass).
    if (!s_.reduces_gradients) return Status::Ok();
    TESSERA_ASSIGN_OR_RETURN(grads, s_.sharding->ReduceAccumulatedGradients(s_, r, groups, grads));
    for (size_t i = 0; i < groups.size(); ++i) rank.grad[groups[i]] = grads[i];
    return Status::Ok();
  }

  PlanState& s_;
  std::vector<Attrs> layer_attrs_;            // per layer
  std::vector<std::vector<size_t>> readers_;  // per group: the layers whose forward reads it
  std::vector<bool> split_;  // per layer: its backward runs as two tasks (SplitsLayerBackward)
  // Per layer: the indices of its forward's outputs only its backward reads.
  std::vector<std::set<int>> saved_only_;
  // The gradient bucket being filled (AddToBucket): its groups, their full gradients, bytes.
  std::vector<size_t> bucket_;
  std::vector<ObjectId> bucket_fulls_;
  int64_t bucket_filled_ = 0;
};

}  // namespace

Status ExpandLayersPass(PlanState& state) { return Expansion(state).Run(); }

}  // namespace tessera
