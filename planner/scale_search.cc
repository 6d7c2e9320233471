#include "planner/scale_search.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <map>
#include <tuple>

#include <fmt/format.h>

namespace tessera {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kActivationBytes = 2;  // bf16 activations, as Korthikanti et al. count them
constexpr double kLogitBytes = 4;       // fp32 logits for the loss, and their gradient
// Adam's memory traffic per owned parameter: read the gradient, the fp32 master weight and both
// moments, write the three and the low-precision copy.
constexpr double kAdamBytesPerParameter = 32;

struct Link {
  double gb_per_s = 0, latency_us = 0;
};

enum class Ring : uint8_t { kAllReduce, kReduceScatter, kAllGather };

// A ring collective among n ranks over a tensor of `bytes` (its whole size).
double RingMs(double bytes, int n, Ring ring, Link link) {
  if (n <= 1 || bytes <= 0) return 0;
  const double steps = ring == Ring::kAllReduce ? 2.0 * (n - 1) : n - 1.0;
  const double traffic = bytes * steps / n;
  return traffic / (link.gb_per_s * 1e9) * 1e3 + steps * link.latency_us * 1e-3;
}

// A group of n ranks `stride` apart, aligned: inside one node when it spans at most a node.
bool InOneNode(const DescribedCluster& cluster, int n, int stride) {
  const int64_t span = static_cast<int64_t>(n - 1) * stride + 1;
  return span <= cluster.gpus_per_node && cluster.gpus_per_node % (n * stride) == 0;
}

Link LinkFor(const DescribedCluster& cluster, bool in_node) {
  return in_node ? Link{cluster.nvlink_gb_per_s, cluster.nvlink_latency_us}
                 : Link{cluster.network_gb_per_s, cluster.network_latency_us};
}

// A layer's ops on one micro-batch, split as the runtime's tasks are.
struct LayerOps {
  double forward = 0;      // F
  double input_half = 0;   // B: the input gradients (and the attention core)
  double weight_half = 0;  // W: the weight gradients
};

struct Candidate {
  PlanChoice choice;
  int b = 1;  // micro-batch size
  RankLayout layout = RankLayout::kStagesInNode;
};

// Layers per chunk, c = 0 .. P V - 1: the remainder spread over the first chunks.
std::vector<int> ChunkLayers(int64_t layers, int chunks) {
  std::vector<int> counts(static_cast<size_t>(chunks), static_cast<int>(layers / chunks));
  for (int c = 0; c < static_cast<int>(layers % chunks); ++c) ++counts[static_cast<size_t>(c)];
  return counts;
}

class Evaluator {
 public:
  Evaluator(const DescribedCluster& cluster, const TransformerShape& shape,
            const ScaleTraining& training)
      : cluster_(cluster), shape_(shape), training_(training) {}

  // The plan's costs, with the fewest layers recomputed per stage that fit. Infeasible when it
  // cannot fit: then *shortfall_gib (if given) is how far over it stays with every layer
  // recomputed (per GPU; for the host, a node's excess over its GPUs).
  Result<ScalePlan> Evaluate(const Candidate& candidate, double* shortfall_gib = nullptr) const;

 private:
  double ComputeMs(double flops, double bytes) const {
    return flops / (cluster_.peak_tflops * 1e12 * cluster_.gemm_efficiency) * 1e3 +
           bytes / (cluster_.memory_gb_per_s * 1e9) * 1e3;
  }
  // A layer on a micro-batch of b rows on one of t tensor ranks (sharding the sequence when
  // `sequence_sharded`), each of whose activation all-reduces (or reduce-scatter and all-gather)
  // takes `all_reduce_ms`.
  LayerOps Layer(int b, int t, bool sequence_sharded, double all_reduce_ms) const;
  double ModelStateBytes(const PlanChoice& choice, double stage_params, double layer_params) const;

  // The schedule's order for these dimensions and stage costs, and the micro-batches each stage
  // holds in it: zb-h1's list schedule is the search's most expensive step, and candidates that
  // differ only in what does not change the costs (offload, the layout on one link, ZeRO-0 and
  // 1) share it.
  struct Order {
    std::vector<std::vector<PipelineOp>> ops;  // per stage
    std::vector<int> peak_in_flight;           // per stage
    // Its simulations by chunk costs (F, B, W of each chunk in turn): candidates that differ in
    // what leaves the chunks' costs alone (ZeRO-0 and 1 or offload when nothing is recomputed)
    // share one.
    std::map<std::vector<double>, ScheduleSimulation> simulations;
  };
  Order& OrderFor(const PlanChoice& choice, OpCosts costs) const;
  // The simulation of `order` with these chunk costs.
  static Result<ScheduleSimulation> Simulate(Order& order, const PlanChoice& choice,
                                             const std::vector<OpCosts>& costs);

  const DescribedCluster& cluster_;
  const TransformerShape& shape_;
  const ScaleTraining& training_;
  using OrderKey = std::tuple<PipelineSchedule, int, int, int, double, double, double>;
  mutable std::map<OrderKey, Order> orders_;
};

Evaluator::Order& Evaluator::OrderFor(const PlanChoice& choice, OpCosts costs) const {
  const OrderKey key{choice.schedule,       choice.pipeline_stages, choice.micro_batches,
                     choice.virtual_stages, costs.forward,          costs.backward,
                     costs.weight};
  auto it = orders_.find(key);
  if (it == orders_.end()) {
    Order order;
    order.ops = ScheduleOrder(choice.schedule, choice.pipeline_stages, choice.micro_batches,
                              choice.virtual_stages, costs);
    order.peak_in_flight = PeakInFlight(order.ops, SplitsBackward(choice.schedule));
    it = orders_.emplace(key, std::move(order)).first;
  }
  return it->second;
}

Result<ScheduleSimulation> Evaluator::Simulate(Order& order, const PlanChoice& choice,
                                               const std::vector<OpCosts>& costs) {
  std::vector<double> key;
  key.reserve(3 * costs.size());
  for (const OpCosts& cost : costs) {
    key.insert(key.end(), {cost.forward, cost.backward, cost.weight});
  }
  auto it = order.simulations.find(key);
  if (it == order.simulations.end()) {
    TESSERA_ASSIGN_OR_RETURN(ScheduleSimulation sim,
                             SimulateSchedule(order.ops, choice.pipeline_stages,
                                              choice.virtual_stages, choice.micro_batches, costs));
    it = order.simulations.emplace(std::move(key), std::move(sim)).first;
  }
  return it->second;
}

LayerOps Evaluator::Layer(int b, int t, bool sequence_sharded, double all_reduce_ms) const {
  const double s = static_cast<double>(shape_.seq_len), h = static_cast<double>(shape_.hidden);
  const double core = 4.0 * s * s * h * b / t;  // Q K^T and the weighted sum of V, its heads
  const double gemm = shape_.LayerForwardFlops() * b / t - core;
  const double traffic = shape_.LayerForwardTrafficBytes(t, sequence_sharded) * b;
  // Tensor slicing: two all-reduces of the activations in the forward (after the attention's
  // and the MLP's row-parallel linears), two of their gradients in the input half.
  const double all_reduces = 2 * all_reduce_ms;
  LayerOps ops;
  ops.forward = ComputeMs(gemm + core, traffic) + all_reduces;
  ops.input_half = ComputeMs(gemm + 2 * core, 2 * traffic) + all_reduces;
  ops.weight_half = ComputeMs(gemm, 0);
  return ops;
}

double Evaluator::ModelStateBytes(const PlanChoice& choice, double stage_params,
                                  double layer_params) const {
  const double d = choice.data_parallel;
  const double w = training_.weight_bytes, g = training_.gradient_bytes;
  const double o = choice.offload == OffloadMode::kNone ? training_.optimizer_bytes : 0;
  switch (choice.data_parallel > 1 ? choice.zero_stage : 0) {
    case 0:
      return (w + g + o) * stage_params;
    case 1:
      return (w + g) * stage_params + o * stage_params / d;
    case 2:  // + one layer's transient gradient bucket before its reduce-scatter
      return w * stage_params + (g + o) * stage_params / d + g * layer_params;
    default: {
      // Pipelines gather each layer once a step and keep it (GatherPolicy::kAuto); one stage
      // gathers per use: the layer it runs and the next one (prefetch), and a gradient bucket.
      const double gathered =
          choice.pipeline_stages > 1 ? w * stage_params : (2 * w + g) * layer_params;
      return (w + g + o) * stage_params / d + gathered;
    }
  }
}

Result<ScalePlan> Evaluator::Evaluate(const Candidate& candidate, double* shortfall_gib) const {
  const PlanChoice& choice = candidate.choice;
  const int p = choice.pipeline_stages, v = choice.virtual_stages, d = choice.data_parallel;
  const int t = choice.tensor_parallel;
  const int chunks = p * v;
  const int b = candidate.b, m = choice.micro_batches;
  if (shape_.layers < chunks) {
    return InvalidArgument("{}: {} layers cannot fill {} pipeline chunks", shape_.name,
                           shape_.layers, chunks);
  }
  TESSERA_RETURN_IF_ERROR(CheckSchedule(choice.schedule, p, m, v));
  const double s = static_cast<double>(shape_.seq_len), h = static_cast<double>(shape_.hidden);
  const double vocab = static_cast<double>(shape_.vocab);

  // Links: the tensor ranks (innermost: side by side), a stage's data-parallel group and the
  // pipeline's neighbours.
  const bool stages_in_node = candidate.layout == RankLayout::kStagesInNode;
  const Link tp_link = LinkFor(cluster_, InOneNode(cluster_, t, 1));
  const Link dp_link = LinkFor(cluster_, InOneNode(cluster_, d, stages_in_node ? p * t : t));
  const Link p2p_link = LinkFor(cluster_, InOneNode(cluster_, p, stages_in_node ? t : d * t));

  // One all-reduce of a micro-batch's activations [s, b, h] over the tensor ranks; sharding the
  // sequence, a reduce-scatter and an all-gather in its place (the same ring time).
  const bool sp = choice.shard_sequence;
  const double activation_bytes = s * h * b * kActivationBytes;
  const double activation_all_reduce =
      sp ? RingMs(activation_bytes, t, Ring::kReduceScatter, tp_link) +
               RingMs(activation_bytes, t, Ring::kAllGather, tp_link)
         : RingMs(activation_bytes, t, Ring::kAllReduce, tp_link);
  const LayerOps layer = Layer(b, t, sp, activation_all_reduce);
  const std::vector<int> chunk_layers = ChunkLayers(shape_.layers, chunks);
  // Parameters per tensor rank.
  const double layer_params = static_cast<double>(shape_.LayerSplitParameters()) / t +
                              static_cast<double>(shape_.LayerReplicatedParameters());
  // The embedding and the classifier: split by vocabulary over the tensor ranks where T divides
  // the vocabulary (as model/gpt2.cc splits GPT-2), or whole.
  const bool split_vocab = training_.vocab_parallel && t > 1 && shape_.vocab % t == 0;
  const double vocab_share = split_vocab ? 1.0 / t : 1.0;
  const double embedding_params = static_cast<double>(shape_.EmbeddingParameters()) * vocab_share;
  // The last stage's classifier: its own, or (tied, P > 1) a copy of the embedding, as
  // Megatron-LM keeps it; with one stage the tied weights are the embedding's.
  const bool tied = !shape_.llama_style;
  const double head_params = (static_cast<double>(shape_.HeadParameters()) +
                              (tied && p > 1 ? static_cast<double>(shape_.vocab) * h : 0)) *
                             vocab_share;
  const double p2p_bytes = s * b * h * kActivationBytes;
  const double p2p_ms =
      p > 1 ? p2p_bytes / (p2p_link.gb_per_s * 1e9) * 1e3 + p2p_link.latency_us * 1e-3 : 0;
  // Split by vocabulary, the embedding's lookups are summed over the tensor ranks, and so is
  // the gradient entering the last layer from the classifier (the cross-entropy's own
  // all-reduces are of a few numbers per row). Sharding the sequence, the sum is a
  // reduce-scatter (its gradient all-gathered back) and the classifier's input gradient is
  // summed by the last layer's gather.
  const double vocab_all_reduce = split_vocab && !sp ? activation_all_reduce : 0;
  const double embedding_forward_collective =
      !split_vocab ? 0
      : sp         ? RingMs(activation_bytes, t, Ring::kReduceScatter, tp_link)
                   : activation_all_reduce;
  const double embedding_backward_collective =
      split_vocab && sp ? RingMs(activation_bytes, t, Ring::kAllGather, tp_link) : 0;
  const double head_forward = ComputeMs(shape_.HeadForwardFlops() * b * vocab_share,
                                        2 * kLogitBytes * s * vocab * b * vocab_share);
  const double head_backward = ComputeMs(2 * shape_.HeadForwardFlops() * b * vocab_share,
                                         2 * kLogitBytes * s * vocab * b * vocab_share) +
                               vocab_all_reduce;

  // Per stage: its layers and parameters.
  std::vector<int> stage_layers(static_cast<size_t>(p), 0);
  std::vector<double> stage_params(static_cast<size_t>(p), 0);
  for (int c = 0; c < chunks; ++c) {
    stage_layers[static_cast<size_t>(c % p)] += chunk_layers[static_cast<size_t>(c)];
    stage_params[static_cast<size_t>(c % p)] += chunk_layers[static_cast<size_t>(c)] * layer_params;
  }
  stage_params.front() += embedding_params;
  stage_params.back() += head_params;

  const bool zero3 = d > 1 && choice.zero_stage == 3, zero2 = d > 1 && choice.zero_stage == 2;
  // The parameters a rank updates (its shard under ZeRO >= 1), of a stage's.
  const double update_share = d > 1 && choice.zero_stage >= 1 ? 1.0 / d : 1.0;
  const bool split = SplitsBackward(choice.schedule);
  // Chunk costs with a fraction of each stage's layers recomputed. The data-parallel traffic a
  // chunk's ops wait on (ZeRO-2/3) is priced per op: with overlap the op takes the longer of its
  // compute and its communication, else their sum; chunk_wait[c] is what a micro-batch's ops on
  // chunk c spend beyond their compute.
  const bool overlap = training_.overlap_communication;
  auto hidden = [overlap](double compute, double communication) {
    return overlap ? std::max(compute, communication) : compute + communication;
  };
  std::vector<double> chunk_wait(static_cast<size_t>(chunks), 0);
  auto chunk_costs = [&](const std::vector<double>& recompute_fraction) {
    std::vector<OpCosts> costs(static_cast<size_t>(chunks));
    for (int c = 0; c < chunks; ++c) {
      const double n = chunk_layers[static_cast<size_t>(c)];
      const double r = n * recompute_fraction[static_cast<size_t>(c % p)];
      OpCosts& cost = costs[static_cast<size_t>(c)];
      cost.forward = n * layer.forward;
      double input = n * layer.input_half + r * layer.forward, weight = n * layer.weight_half;
      if (c == 0) {  // the embedding
        cost.forward +=
            ComputeMs(0, 2 * kActivationBytes * s * h * b) + embedding_forward_collective;
        input += embedding_backward_collective;
      }
      if (c == chunks - 1) {
        cost.forward += head_forward;
        input += head_backward / 2;
        weight += head_backward / 2;
      }
      const double params = n * layer_params;
      const double grad_bytes = training_.gradient_bytes * params;
      const double reduce =
          zero2 || zero3 ? RingMs(grad_bytes, d, Ring::kReduceScatter, dp_link) : 0;
      const double gather =
          zero3 && p == 1 ? RingMs(training_.weight_bytes * params, d, Ring::kAllGather, dp_link)
                          : 0;
      const double compute = cost.forward + input + weight;
      cost.forward = hidden(cost.forward, gather);
      if (split) {
        cost.backward = hidden(input, gather);
        cost.weight = hidden(weight, reduce);
      } else {
        cost.backward = hidden(input + weight, gather + reduce);
        cost.weight = 0;
      }
      chunk_wait[static_cast<size_t>(c)] = cost.forward + cost.backward + cost.weight - compute;
      if (c > 0) cost.forward += p2p_ms;
      if (c < chunks - 1) cost.backward += p2p_ms;
    }
    return costs;
  };

  // The order (zb-h1's by the costs of a stage without recompute) and the micro-batches it holds.
  const std::vector<double> no_recompute(static_cast<size_t>(p), 0);
  const std::vector<OpCosts> plain = chunk_costs(no_recompute);
  OpCosts stage_costs{0, 0, 0};
  for (int c = 0; c < v; ++c) {
    stage_costs.forward += plain[static_cast<size_t>(c) * static_cast<size_t>(p)].forward;
    stage_costs.backward += plain[static_cast<size_t>(c) * static_cast<size_t>(p)].backward;
    stage_costs.weight += plain[static_cast<size_t>(c) * static_cast<size_t>(p)].weight;
  }
  Order& order = OrderFor(choice, split ? stage_costs : OpCosts{1, 1, 1});

  // Memory per stage; the fewest recomputed layers that fit.
  const double cap = (cluster_.gpu_memory_gib - cluster_.reserved_gib) * kGiB;
  const double act_layer = shape_.LayerActivationBytes(t, sp) * b;
  // A recomputed layer's checkpoint: its input, 1/T of it sharding the sequence.
  const double kept_input = kActivationBytes * s * h * b / (sp ? t : 1);
  std::vector<double> recompute(static_cast<size_t>(p), 0);
  ScalePlan plan;
  plan.choice = choice;
  plan.micro_batch_size = b;
  plan.layout = candidate.layout;
  double worst_over = -1e300;
  for (int st = 0; st < p; ++st) {
    const size_t i = static_cast<size_t>(st);
    const double n = stage_layers[i];
    // Chunk-micro-batches in flight x layers per chunk: the stage's layer activations held.
    const double held = order.peak_in_flight[i] * n / v;
    const double state = ModelStateBytes(choice, stage_params[i], layer_params);
    double working = act_layer;  // the layer being rebuilt or differentiated
    if (st == p - 1) working += 2 * kLogitBytes * s * vocab * b * vocab_share;
    const double fixed = state + working;
    // held x ((1 - f) act + f kept) + fixed <= cap
    double f = 0;
    const double full = held * act_layer + fixed;
    if (full > cap) {
      f = held * (act_layer - kept_input) > 0 ? (full - cap) / (held * (act_layer - kept_input))
                                              : 2;
      // Whole layers: round the recomputed count up.
      f = n > 0 ? std::ceil(f * n - 1e-9) / n : f;
    }
    const double used_f = std::min(f, 1.0);
    const double used = held * ((1 - used_f) * act_layer + used_f * kept_input) + fixed;
    worst_over = std::max(worst_over, used - cap);
    recompute[i] = used_f;
    if (used / kGiB > plan.peak_gib) {
      plan.peak_gib = used / kGiB;
      plan.costs.model_state_gib = state / kGiB;
      plan.costs.activation_gib = (used - fixed) / kGiB;
      plan.costs.working_gib = working / kGiB;
      plan.costs.peak_in_flight = order.peak_in_flight[i];
    }
    plan.layers_per_stage = std::max(plan.layers_per_stage, static_cast<int>(n));
    plan.recomputed_layers =
        std::max(plan.recomputed_layers, static_cast<int>(std::lround(used_f * n)));
  }
  plan.peak_gib += cluster_.reserved_gib;
  // The optimizer's host memory, with offload: a node's GPUs' shards.
  if (choice.offload != OffloadMode::kNone) {
    const double largest = *std::max_element(stage_params.begin(), stage_params.end());
    const double owned = largest * update_share;
    const double host = training_.optimizer_bytes * owned * cluster_.gpus_per_node / kGiB;
    if (host > cluster_.host_memory_gib) {
      if (shortfall_gib != nullptr) {
        *shortfall_gib = (host - cluster_.host_memory_gib) / cluster_.gpus_per_node;
      }
      return Infeasible(
          "{}: the offloaded optimizer needs {:.0f} GiB of host memory per node, "
          "{:.0f} GiB over its {:.0f} GiB; use more data-parallel ranks with ZeRO >= "
          "1",
          plan.Name(), host, host - cluster_.host_memory_gib, cluster_.host_memory_gib);
    }
  }
  if (worst_over > 0) {
    if (shortfall_gib != nullptr) *shortfall_gib = worst_over / kGiB;
    return Infeasible(
        "{}: needs {:.1f} GiB per GPU with every layer recomputed, {:.1f} GiB over the {:.0f} GiB "
        "(less {:.0f} reserved)",
        plan.Name(), (worst_over + cap) / kGiB + cluster_.reserved_gib, worst_over / kGiB,
        cluster_.gpu_memory_gib, cluster_.reserved_gib);
  }

  // Time: the pipeline with the recompute, then what follows the last backward.
  const std::vector<OpCosts> costs = chunk_costs(recompute);
  TESSERA_ASSIGN_OR_RETURN(ScheduleSimulation sim, Simulate(order, choice, costs));
  plan.costs.pipeline_ms = sim.makespan;
  plan.costs.bubble = sim.bubble;
  plan.costs.p2p_ms = p2p_ms;
  plan.costs.forward_ms = 0;
  plan.costs.backward_ms = 0;
  for (const OpCosts& cost : costs) {
    plan.costs.forward_ms = std::max(plan.costs.forward_ms, cost.forward);
    plan.costs.backward_ms = std::max(plan.costs.backward_ms, cost.backward + cost.weight);
  }

  // What each stage does after its last backward: its data-parallel communication and its
  // optimizer step. The step ends when the last stage to finish them does.
  struct After {
    double exposed = 0, optimizer = 0;
  };
  auto after_backward = [&](size_t stage) {
    After after;
    const double params = stage_params[stage];
    const double grad_bytes = training_.gradient_bytes * params;
    const double weight_bytes = training_.weight_bytes * params;
    double& exposed = after.exposed;
    if (d > 1) {
      // The last micro-batch's backward over the stage hides all but its last layer's reduction.
      double last_backward = 0;
      for (int c = 0; c < v; ++c) {
        last_backward += costs[static_cast<size_t>(c) * static_cast<size_t>(p) + stage].backward +
                         costs[static_cast<size_t>(c) * static_cast<size_t>(p) + stage].weight;
      }
      const double n = std::max(1, stage_layers[stage]);
      auto overlapped = [&](double ms) {
        return overlap ? std::max(ms - last_backward * (n - 1) / n, ms / n) : ms;
      };
      switch (choice.zero_stage) {
        case 0:
          exposed = overlapped(RingMs(grad_bytes, d, Ring::kAllReduce, dp_link));
          break;
        case 1:
          exposed = overlapped(RingMs(grad_bytes, d, Ring::kReduceScatter, dp_link)) +
                    RingMs(weight_bytes, d, Ring::kAllGather, dp_link);
          break;
        case 2:  // the reduce-scatters ran with each backward; the updated shards gathered
          exposed = RingMs(weight_bytes, d, Ring::kAllGather, dp_link);
          break;
        default:
          // A pipeline gathers each layer once a step: the first forward hides all but the first
          // layer's gather.
          if (p > 1) {
            const double gather = RingMs(weight_bytes, d, Ring::kAllGather, dp_link);
            exposed = overlap ? std::max(gather - costs[stage].forward, gather / n) : gather;
          }
          break;
      }
    }
    const double owned = params * update_share;
    if (choice.offload == OffloadMode::kNone) {
      after.optimizer = kAdamBytesPerParameter * owned / (cluster_.memory_gb_per_s * 1e9) * 1e3;
    } else {
      const double pcie = (training_.gradient_bytes + training_.weight_bytes) * owned /
                          (cluster_.pcie_gb_per_s * 1e9) * 1e3;
      const double host_share = cluster_.host_memory_gb_per_s / cluster_.gpus_per_node;
      after.optimizer = pcie + kAdamBytesPerParameter * owned / (host_share * 1e9) * 1e3;
    }
    return after;
  };
  size_t ending = 0;  // the stage that ends the step
  plan.step_ms = 0;
  for (size_t st = 0; st < static_cast<size_t>(p); ++st) {
    const After after = after_backward(st);
    const double end = sim.stage_end[st] + after.exposed + after.optimizer;
    if (end > plan.step_ms) {
      plan.step_ms = end;
      ending = st;
      plan.costs.data_parallel_ms = after.exposed;
      plan.costs.optimizer_ms = after.optimizer;
    }
  }

  // The bottleneck: the largest of the ending stage's compute and what it waits for.
  double busy = 0, waits = 0;
  for (int c = 0; c < v; ++c) {
    const size_t chunk = static_cast<size_t>(c) * static_cast<size_t>(p) + ending;
    busy += m * (costs[chunk].forward + costs[chunk].backward + costs[chunk].weight);
    waits += m * chunk_wait[chunk];
  }
  const double p2p_total = 2.0 * m * v * p2p_ms;
  const double communication = plan.costs.data_parallel_ms + p2p_total + waits;
  const double bubble = std::max(0.0, sim.stage_end[ending] - busy);
  const double swap = choice.offload == OffloadMode::kNone ? 0 : plan.costs.optimizer_ms;
  const std::array<std::pair<double, Bottleneck>, 4> parts{
      {{busy - p2p_total - waits, Bottleneck::kCompute},
       {bubble, Bottleneck::kBubble},
       {communication, Bottleneck::kCommunication},
       {swap, Bottleneck::kSwap}}};
  plan.bottleneck = std::max_element(parts.begin(), parts.end())->second;

  const double gpus = static_cast<double>(d) * t * p;
  plan.model_tflops =
      ModelStepFlops(shape_, training_.global_batch) / (plan.step_ms * 1e-3) / gpus / 1e12;
  plan.megatron_tflops = shape_.llama_style ? 0
                                            : MegatronStepFlops(shape_, training_.global_batch) /
                                                  (plan.step_ms * 1e-3) / gpus / 1e12;
  return plan;
}

std::vector<int> Divisors(int n) {
  std::vector<int> divisors;
  for (int k = 1; k <= n; ++k) {
    if (n % k == 0) divisors.push_back(k);
  }
  return divisors;
}

// The candidates with t tensor ranks over `gpus` GPUs, in the search's order: one loop per
// dimension.
void AddCandidates(const TransformerShape& shape, const ScaleTraining& training,
                   const ScaleSpace& space, int gpus, int t, bool sp,
                   std::vector<Candidate>& candidates) {
  for (int p : Divisors(gpus / t)) {
    if (p > shape.layers) break;
    const int d = gpus / t / p;
    if (training.global_batch % d != 0) continue;
    const int64_t rows = training.global_batch / d;
    std::vector<std::pair<PipelineSchedule, int>> schedules;
    if (p == 1) {
      schedules.emplace_back(PipelineSchedule::k1F1B, 1);
    } else {
      for (PipelineSchedule schedule : space.schedules) {
        const int v = schedule == PipelineSchedule::kInterleaved ? 2 : 1;
        if (shape.layers >= static_cast<int64_t>(p) * v) schedules.emplace_back(schedule, v);
      }
    }
    for (const auto& [schedule, v] : schedules) {
      for (int b : space.micro_batch_sizes) {
        if (b < 1 || rows % b != 0) continue;
        const int64_t m = rows / b;
        if (m > space.max_micro_batches) continue;
        if (!CheckSchedule(schedule, p, static_cast<int>(m), v).ok()) continue;
        for (int zero : space.zero_stages) {
          if (d == 1 && zero != 0) continue;
          for (OffloadMode offload : {OffloadMode::kNone, OffloadMode::kOptimizer}) {
            if (offload != OffloadMode::kNone && !space.offload) continue;
            for (RankLayout layout : {RankLayout::kStagesInNode, RankLayout::kReplicasInNode}) {
              if ((d == 1 || p == 1) && layout != RankLayout::kStagesInNode) continue;
              Candidate candidate;
              candidate.choice.data_parallel = d;
              candidate.choice.tensor_parallel = t;
              candidate.choice.shard_sequence = sp;
              candidate.choice.pipeline_stages = p;
              candidate.choice.virtual_stages = v;
              candidate.choice.micro_batches = static_cast<int>(m);
              candidate.choice.schedule = schedule;
              candidate.choice.zero_stage = zero;
              candidate.choice.offload = offload;
              candidate.b = b;
              candidate.layout = layout;
              candidates.push_back(candidate);
            }
          }
        }
      }
    }
  }
}

// Whether the runtime shards the sequence over t tensor ranks (model/gpt2.cc: the embedding and
// classifier split by vocabulary, the sequence split evenly).
bool CanShardSequence(const TransformerShape& shape, const ScaleTraining& training, int t) {
  return t > 1 && training.vocab_parallel && shape.vocab % t == 0 && shape.seq_len % t == 0;
}

// The candidates over `gpus` GPUs, in the search's order: the tensor-parallel degrees that split
// the layers inside a node, with and without sharding the sequence, then AddCandidates' loops.
std::vector<Candidate> Candidates(const DescribedCluster& cluster, const TransformerShape& shape,
                                  const ScaleTraining& training, const ScaleSpace& space,
                                  int gpus) {
  std::vector<Candidate> candidates;
  for (int t : space.tensor_parallel) {
    if (t < 1 || gpus % t != 0 || !shape.SplitsOver(t) || !InOneNode(cluster, t, 1)) continue;
    for (bool sp : space.shard_sequence) {
      if (sp && !CanShardSequence(shape, training, t)) continue;
      AddCandidates(shape, training, space, gpus, t, sp, candidates);
    }
  }
  return candidates;
}

std::string Gib(double gib) { return fmt::format("{:.1f} GiB", gib); }

}  // namespace

Status DescribedCluster::Validate() const {
  auto positive = [](double value, const char* field) -> Status {
    if (!(value > 0) || !std::isfinite(value)) {
      return InvalidArgument("cluster: {} must be positive, got {}", field, value);
    }
    return Status::Ok();
  };
  if (nodes < 1) return InvalidArgument("cluster: nodes must be >= 1, got {}", nodes);
  if (gpus_per_node < 1) {
    return InvalidArgument("cluster: gpus_per_node must be >= 1, got {}", gpus_per_node);
  }
  TESSERA_RETURN_IF_ERROR(positive(gpu_memory_gib, "gpu_memory_gib"));
  if (reserved_gib < 0 || reserved_gib >= gpu_memory_gib) {
    return InvalidArgument("cluster: reserved_gib {} must be in [0, gpu_memory_gib {})",
                           reserved_gib, gpu_memory_gib);
  }
  TESSERA_RETURN_IF_ERROR(positive(peak_tflops, "peak_tflops"));
  if (!(gemm_efficiency > 0 && gemm_efficiency <= 1)) {
    return InvalidArgument("cluster: gemm_efficiency must be in (0, 1], got {}", gemm_efficiency);
  }
  TESSERA_RETURN_IF_ERROR(positive(memory_gb_per_s, "memory_gb_per_s"));
  TESSERA_RETURN_IF_ERROR(positive(nvlink_gb_per_s, "nvlink_gb_per_s"));
  TESSERA_RETURN_IF_ERROR(positive(network_gb_per_s, "network_gb_per_s"));
  TESSERA_RETURN_IF_ERROR(positive(pcie_gb_per_s, "pcie_gb_per_s"));
  TESSERA_RETURN_IF_ERROR(positive(host_memory_gib, "host_memory_gib"));
  TESSERA_RETURN_IF_ERROR(positive(host_memory_gb_per_s, "host_memory_gb_per_s"));
  if (nvlink_latency_us < 0 || network_latency_us < 0) {
    return InvalidArgument("cluster: latencies must be >= 0");
  }
  return Status::Ok();
}

int64_t TransformerShape::LayerParameters() const {
  const int64_t h = hidden, kv = hidden / heads * KvHeads(), f = Ffn();
  if (llama_style) return 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h;
  // Attention (q, k, v, output with biases), the MLP with biases, two layer norms.
  return 2 * h * h + 2 * h * kv + (2 * h + 2 * kv) + 2 * h * f + f + h + 4 * h;
}

int64_t TransformerShape::LayerSplitParameters() const {
  const int64_t h = hidden, kv = hidden / heads * KvHeads(), f = Ffn();
  if (llama_style) return 2 * h * h + 2 * h * kv + 3 * h * f;
  // The matrices, the QKV and first MLP biases (column-parallel).
  return 2 * h * h + 2 * h * kv + 2 * h * f + (h + 2 * kv) + f;
}

bool TransformerShape::SplitsOver(int t) const {
  return t >= 1 && heads % t == 0 && KvHeads() % t == 0 && Ffn() % t == 0 && hidden % t == 0;
}

int64_t TransformerShape::EmbeddingParameters() const {
  return vocab * hidden + (llama_style ? 0 : seq_len * hidden);
}

int64_t TransformerShape::HeadParameters() const {
  return llama_style ? hidden + vocab * hidden : 2 * hidden;
}

int64_t TransformerShape::Parameters() const {
  return layers * LayerParameters() + EmbeddingParameters() + HeadParameters();
}

double TransformerShape::LayerForwardFlops() const {
  const double s = static_cast<double>(seq_len), h = static_cast<double>(hidden);
  const double kv = h / static_cast<double>(heads) * static_cast<double>(KvHeads());
  const double f = static_cast<double>(Ffn());
  const double matrices = 2 * h * h + 2 * h * kv + (llama_style ? 3 : 2) * h * f;
  return 2 * s * matrices + 4 * s * s * h;
}

double TransformerShape::HeadForwardFlops() const {
  return 2.0 * static_cast<double>(seq_len) * static_cast<double>(hidden) *
         static_cast<double>(vocab);
}

double TransformerShape::LayerForwardTrafficBytes(int t, bool sequence_sharded) const {
  // Elements read and written by the element-wise ops, each its own kernel: on every tensor
  // rank (replicated) or on its share of the heads and MLP columns (split).
  const double s = static_cast<double>(seq_len), h = static_cast<double>(hidden);
  const double kv = h / static_cast<double>(heads) * static_cast<double>(KvHeads());
  const double f = static_cast<double>(Ffn()), a = static_cast<double>(heads);
  double replicated = 0, split = 0;
  if (llama_style) {
    // Two RMSNorms (read, write), two residual adds (read 2, write 1); SiLU(gate) x up (read 2,
    // write 1), rotary embedding of q and k (read, write).
    replicated = 4 * s * h + 6 * s * h;
    split = 3 * s * f + 2 * (s * h + s * kv);
  } else {
    // Two layer norms; bias, dropout (a byte mask) and residual after the projection and after
    // the MLP; GELU with its bias.
    replicated = 4 * s * h + 2 * 3.5 * s * h;
    split = 2 * s * f;
  }
  if (!flash_attention) {
    // Scale, mask and softmax (read, write); dropout of the probabilities (GPT: read, write, a
    // byte mask).
    split += 2 * a * s * s + (llama_style ? 0 : 2.5 * a * s * s);
  }
  return (replicated / (sequence_sharded ? t : 1) + split / t) * kActivationBytes;
}

double TransformerShape::LayerActivationBytes(int t, bool sequence_sharded) const {
  // Korthikanti et al. 2022, sections 4.1-4.2, generalised to the MLP width, grouped-query
  // attention, the Llama layer and flash attention.
  const double s = static_cast<double>(seq_len), h = static_cast<double>(hidden);
  const double kv = h / static_cast<double>(heads) * static_cast<double>(KvHeads());
  const double f = static_cast<double>(Ffn()), a = static_cast<double>(heads);
  const bool dropout = !llama_style;
  // On every tensor rank: the attention's and the MLP's inputs, the dropout masks after the
  // row-parallel linears, the two norms' inputs.
  const double replicated = 2 * s * h + 2 * s * h + (dropout ? 2 * s * h : 0) + 4 * s * h;
  // On the rank's heads and columns: Q, K, V and the projection's input; the MLP's inner
  // activations (GPT: the GELU's input and output; Llama: gate, up, product).
  double split = 2 * s * h + 4 * s * kv + 2 * s * h;
  if (flash_attention) {
    split += 4 * a * s;  // the softmax's log-sum-exp, fp32
  } else {
    split += 2 * a * s * s + (dropout ? 3 * a * s * s : 0);  // softmax out; dropout mask and out
  }
  split += llama_style ? 6 * s * f : 4 * s * f;
  return replicated / (sequence_sharded ? t : 1) + split / t;
}

Status TransformerShape::Validate() const {
  if (layers < 1 || hidden < 1 || heads < 1 || vocab < 1 || seq_len < 1) {
    return InvalidArgument("model {}: layers, hidden, heads, vocab and seq_len must be >= 1", name);
  }
  if (hidden % heads != 0) {
    return InvalidArgument("model {}: hidden {} is not a multiple of heads {}", name, hidden,
                           heads);
  }
  if (heads % KvHeads() != 0) {
    return InvalidArgument("model {}: heads {} is not a multiple of kv_heads {}", name, heads,
                           KvHeads());
  }
  return Status::Ok();
}

Result<TransformerShape> TransformerShape::Preset(std::string_view name) {
  TransformerShape shape;
  shape.name = std::string(name);
  if (name == "gpt3-175b") {
    shape.layers = 96, shape.hidden = 12288, shape.heads = 96, shape.vocab = 51200;
    shape.seq_len = 2048, shape.published_batch = 1536;
  } else if (name == "megatron-76b") {
    shape.layers = 60, shape.hidden = 10240, shape.heads = 80, shape.vocab = 51200;
    shape.seq_len = 2048, shape.published_batch = 1792;
  } else if (name == "llama2-70b") {
    shape.layers = 80, shape.hidden = 8192, shape.heads = 64, shape.kv_heads = 8;
    shape.ffn = 28672, shape.vocab = 32000, shape.seq_len = 4096;
    shape.llama_style = true, shape.flash_attention = true;
    shape.published_batch = 1024;  // 4M tokens
  } else if (name == "gpt2-1.5b") {
    shape.layers = 48, shape.hidden = 1600, shape.heads = 25, shape.vocab = 50257;
    shape.seq_len = 1024, shape.published_batch = 512;
  } else {
    return NotFound("model '{}' is not one of: gpt3-175b, megatron-76b, llama2-70b, gpt2-1.5b",
                    name);
  }
  return shape;
}

double MegatronStepFlops(const TransformerShape& shape, int64_t batch) {
  const double s = static_cast<double>(shape.seq_len), h = static_cast<double>(shape.hidden);
  const double l = static_cast<double>(shape.layers), v = static_cast<double>(shape.vocab);
  return 96.0 * static_cast<double>(batch) * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h));
}

double ModelStepFlops(const TransformerShape& shape, int64_t batch) {
  return 3.0 * static_cast<double>(batch) *
         (static_cast<double>(shape.layers) * shape.LayerForwardFlops() + shape.HeadForwardFlops());
}

const char* RankLayoutName(RankLayout layout) {
  return layout == RankLayout::kStagesInNode ? "stages-in-node" : "replicas-in-node";
}

std::string ScalePlan::Name() const {
  std::string name = fmt::format("{} b{}", choice.Name(), micro_batch_size);
  if (recomputed_layers > 0) {
    name += fmt::format(" recompute {}/{}", recomputed_layers, layers_per_stage);
  }
  if (choice.data_parallel > 1 && choice.pipeline_stages > 1) {
    name += fmt::format(" {}", RankLayoutName(layout));
  }
  return name;
}

Result<ScalePlan> EvaluateScalePlan(const DescribedCluster& cluster, const TransformerShape& shape,
                                    const ScaleTraining& training, const PlanChoice& choice,
                                    int micro_batch_size, RankLayout layout) {
  TESSERA_RETURN_IF_ERROR(cluster.Validate());
  TESSERA_RETURN_IF_ERROR(shape.Validate());
  if (choice.workers() > cluster.gpus()) {
    return InvalidArgument("{}: {} GPUs, the cluster has {}", choice.Name(), choice.workers(),
                           cluster.gpus());
  }
  if (!shape.SplitsOver(choice.tensor_parallel)) {
    return InvalidArgument(
        "{}: {}'s layers do not split over {} tensor ranks (its {} heads, {} KV heads, MLP of {} "
        "and hidden {} must divide by it)",
        choice.Name(), shape.name, choice.tensor_parallel, shape.heads, shape.KvHeads(),
        shape.Ffn(), shape.hidden);
  }
  if (choice.shard_sequence && !CanShardSequence(shape, training, choice.tensor_parallel)) {
    return InvalidArgument(
        "{}: sequence parallelism shards each sequence over the tensor ranks, where there are at "
        "least 2 and they divide the vocabulary ({}) and the sequence ({}), the vocabulary split "
        "over them",
        choice.Name(), shape.vocab, shape.seq_len);
  }
  if (micro_batch_size < 1 ||
      static_cast<int64_t>(choice.data_parallel) * choice.micro_batches * micro_batch_size !=
          training.global_batch) {
    return InvalidArgument(
        "{} with micro-batches of {}: D x M x b = {} sequences, the global batch is {}",
        choice.Name(), micro_batch_size,
        static_cast<int64_t>(choice.data_parallel) * choice.micro_batches * micro_batch_size,
        training.global_batch);
  }
  return Evaluator(cluster, shape, training).Evaluate({choice, micro_batch_size, layout});
}

Result<std::vector<ScaleSearchResult>> SearchAtScale(const DescribedCluster& cluster,
                                                     const TransformerShape& shape,
                                                     const ScaleTraining& training,
                                                     const ScaleSpace& space) {
  TESSERA_RETURN_IF_ERROR(cluster.Validate());
  TESSERA_RETURN_IF_ERROR(shape.Validate());
  if (training.global_batch < 1) {
    return InvalidArgument("global batch must be >= 1, got {}", training.global_batch);
  }
  std::vector<int> counts = space.gpus.empty() ? std::vector<int>{cluster.gpus()} : space.gpus;
  const Evaluator evaluator(cluster, shape, training);
  std::vector<ScaleSearchResult> results;
  for (int gpus : counts) {
    if (gpus < 1 || gpus > cluster.gpus()) {
      return InvalidArgument("{} GPUs: the cluster {} has {} ({} nodes x {})", gpus, cluster.name,
                             cluster.gpus(), cluster.nodes, cluster.gpus_per_node);
    }
    const auto start = std::chrono::steady_clock::now();
    ScaleSearchResult result;
    result.gpus = gpus;
    const std::vector<Candidate> candidates = Candidates(cluster, shape, training, space, gpus);
    result.considered = static_cast<int>(candidates.size());
    for (const Candidate& candidate : candidates) {
      double shortfall = 0;
      Result<ScalePlan> plan = evaluator.Evaluate(candidate, &shortfall);
      if (plan.ok()) {
        result.ranked.push_back(*std::move(plan));
        continue;
      }
      ScaleRefusal refusal;
      refusal.plan.choice = candidate.choice;
      refusal.plan.micro_batch_size = candidate.b;
      refusal.plan.layout = candidate.layout;
      refusal.reason = plan.status().message();
      refusal.shortfall_gib = shortfall;
      result.refused.push_back(std::move(refusal));
    }
    // Stable: equal plans stay in the enumeration order.
    std::stable_sort(result.ranked.begin(), result.ranked.end(),
                     [](const ScalePlan& a, const ScalePlan& b) {
                       return std::tie(a.step_ms, a.peak_gib) < std::tie(b.step_ms, b.peak_gib);
                     });
    result.search_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (result.ranked.empty()) {
      const auto closest = std::min_element(result.refused.begin(), result.refused.end(),
                                            [](const ScaleRefusal& a, const ScaleRefusal& b) {
                                              return a.shortfall_gib < b.shortfall_gib;
                                            });
      if (closest == result.refused.end()) {
        return Infeasible(
            "{} on {} GPUs: no plan divides the global batch {} (try a batch that "
            "is a multiple of the data-parallel ranks)",
            shape.name, gpus, training.global_batch);
      }
      return Infeasible(
          "{} on {} GPUs of {}: no plan fits in {} per GPU; the closest is {} short per GPU: {}. "
          "Use more GPUs, GPUs with more memory, or a smaller model",
          shape.name, gpus, cluster.name, Gib(cluster.gpu_memory_gib), Gib(closest->shortfall_gib),
          closest->reason);
    }
    results.push_back(std::move(result));
  }
  return results;
}

std::string DescribeScaleSearch(const ScaleSearchResult& result, int top) {
  std::string text = fmt::format(
      "{} GPUs: {} plans considered, {} fit, {} refused (memory), searched in {:.0f} ms\n",
      result.gpus, result.considered, result.ranked.size(), result.refused.size(),
      result.search_ms);
  text += fmt::format("{:>4}  {:<62} {:>10} {:>8} {:>8} {:>9} {:>7}  {}\n", "rank", "plan",
                      "step (s)", "TF/s", "TF/s", "peak", "bubble", "bottleneck");
  text += fmt::format("{:>4}  {:<62} {:>10} {:>8} {:>8} {:>9} {:>7}\n", "", "", "", "model",
                      "Megatron", "(GiB)", "");
  const int shown = std::min(top, static_cast<int>(result.ranked.size()));
  for (int i = 0; i < shown; ++i) {
    const ScalePlan& plan = result.ranked[static_cast<size_t>(i)];
    const std::string megatron =
        plan.megatron_tflops > 0 ? fmt::format("{:.1f}", plan.megatron_tflops) : "-";
    text += fmt::format("{:>4}  {:<62} {:>10.2f} {:>8.1f} {:>8} {:>9.1f} {:>6.1f}%  {}\n", i + 1,
                        plan.Name(), plan.step_ms / 1e3, plan.model_tflops, megatron, plan.peak_gib,
                        plan.costs.bubble * 100, BottleneckName(plan.bottleneck));
  }
  return text;
}

}  // namespace tessera
