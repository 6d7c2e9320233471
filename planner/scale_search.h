// Plan search at scale, by simulation: the plan search of planner/plan_search.h for a described
// cluster of GPUs (nodes x GPUs, memory, FLOP/s, NVLink / InfiniBand / Ethernet bandwidths: a
// YAML file, launcher/described_cluster.h) and a transformer far too large to profile or to
// plan task by task (GPT-3 175B on 1024 GPUs), in seconds.
//
// The same dimensions are searched, one loop each, in a fixed order:
//   tensor-parallel ranks T (Megatron-LM's tensor slicing, inside a node), data-parallel ranks D
//   x pipeline stages P (D x T x P = the cluster's GPUs),
//   the schedule (gpipe, 1f1b, interleaved with V = 2, zb-h1), the micro-batch size b (rows per
//   micro-batch; M = global batch / (D b) micro-batches), the ZeRO stage (D > 1), optimizer
//   offload to the host, the placement of the ranks on the nodes (a pipeline's stages side by
//   side in a node, or a stage's data-parallel ranks side by side), and the memory planner's
//   decision: how many of a stage's layers recompute their activations (the fewest that fit).
// A candidate that cannot fit in a GPU's memory with every layer recomputed is refused, with its
// shortfall, and never timed; the others are ranked by predicted step time, then the lower
// peak, then the enumeration order.
//
// Symmetry makes it cheap: every data-parallel replica runs the same pipeline, and every layer
// of a transformer costs the same, so one replica's pipeline is simulated (SimulateSchedule over
// the schedule's order with per-chunk costs; the chunks holding the embedding and the head cost
// more) and the data-parallel collectives are priced analytically from the runtime's rules
// (planner/sharding_policy.h: ZeRO-0 and 1 reduce the gradients once a step, 2 reduce-scatters
// each micro-batch's, 3 also gathers the parameters before each forward and backward). No step
// graph is built: a candidate costs the schedule simulation of P stages x M micro-batches.
//
// The cost model, per GPU (every term is named in ScaleCosts, so a result can be explained):
//   compute   a layer's matrix multiplies at peak x gemm_efficiency; its element-wise traffic
//             (norms, softmax, dropout, activation, residuals: counted per tensor read and
//             written) at the memory bandwidth; a backward 2 x the forward's multiplies and
//             traffic (zb-h1 splits it into equal input and weight halves; the attention core
//             is all input half); a recomputed layer runs its forward again before its backward;
//   memory    mixed precision as the published runs (bf16 weights and gradients, fp32 master
//             weights and Adam moments: 2 + 2 + 12 bytes per parameter, the ZeRO paper's K = 12)
//             sharded by the ZeRO stage; activations per layer and micro-batch as Korthikanti et
//             al. count them (s b h (34 + 5 a s / h) bytes for GPT without flash attention), times
//             the most micro-batches a stage holds at once in the schedule's order; a recomputed
//             layer keeps only its input (2 s b h); the last stage's fp32 logits and their
//             gradient; reserved_gib for the CUDA context and workspaces;
//   links     a collective among ranks inside one node runs at the NVLink bandwidth, else at the
//             per-GPU network bandwidth (a ring's bus bandwidth: 2 (n-1)/n of an all-reduce's
//             bytes, (n-1)/n of a reduce-scatter's or all-gather's, plus a latency per ring step);
//             a stage's activations to the next stage take the link between them;
//   overlap   ZeRO-0/1's reduction overlaps the stage's last backward but for its last layer's;
//             ZeRO-2's per-micro-batch reduce-scatter and ZeRO-3's gathers overlap the op they
//             serve (the op takes the longer of its compute and its communication); without
//             overlap (ScaleTraining::overlap_communication) every collective adds its time;
//   optimizer Adam's memory traffic (32 bytes per owned parameter) at the GPU's bandwidth, or
//             with offload: the gradients down and the parameters up over PCIe and the update at
//             the node's host-memory bandwidth shared by its GPUs.
//   tensor    T ranks split each layer's matrix multiplies, attention heads and their element-
//             wise work (not the norms, residuals and the dropouts after the row-parallel
//             linears), its parameters but the replicated ones, and its activations as
//             Korthikanti et al. count them; each layer adds two all-reduces of the activations
//             forward and two backward on the tensor ranks' link, waited for (they sit between
//             a layer's ops); the embedding and classifier are split by vocabulary where T
//             divides it, else whole on every rank (ScaleTraining::vocab_parallel).
//   sequence  with T > 1, Megatron-LM's sequence parallelism (where the runtime runs it: T divides
//             the vocabulary and the sequence): the norms, residuals and dropouts the tensor
//             ranks replicate run on 1/T of each sequence, so their element-wise work and their
//             activations (Korthikanti et al.'s s b h (34 + 5 a s / h) / t) and a recomputed
//             layer's kept input are 1/T; each all-reduce becomes a reduce-scatter and an
//             all-gather (the same ring time), the embedding's sum a reduce-scatter forward and
//             an all-gather backward, and the classifier's input gradient needs none of its own.
// Not modelled: ring attention and Ulysses (not searched), kernel fusion beyond flash
// attention, network contention between collectives, stragglers.
//
// Thread safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "planner/plan_search.h"

namespace tessera {

// A cluster described, not probed: what the simulation needs of its hardware.
struct DescribedCluster {
  std::string name;
  int nodes = 1, gpus_per_node = 8;
  std::string gpu;                // "A100-SXM4-80GB": for the report only
  double gpu_memory_gib = 80;     // per GPU
  double reserved_gib = 2;        // of it, taken by the CUDA context, cuBLAS/NCCL workspaces
  double peak_tflops = 312;       // dense bf16 per GPU
  double gemm_efficiency = 0.8;   // the fraction of peak a layer's large matrix multiplies reach
  double memory_gb_per_s = 2039;  // HBM
  double nvlink_gb_per_s = 300;   // per GPU, each way, inside a node
  double network_gb_per_s = 25;   // per GPU, each way, between nodes (InfiniBand / Ethernet)
  double nvlink_latency_us = 5, network_latency_us = 10;
  double pcie_gb_per_s = 25;          // host <-> GPU, per GPU
  double host_memory_gib = 1024;      // per node
  double host_memory_gb_per_s = 200;  // per node, shared by its GPUs
  int gpus() const { return nodes * gpus_per_node; }
  // InvalidArgument naming the first field out of range.
  Status Validate() const;
};

// A decoder-only transformer by its shape (GPT-2/3 style: learned positions, biases, GELU MLP of
// 4h, dropout, tied embeddings; or Llama style: gated SiLU MLP, grouped-query attention, RMSNorm,
// no biases, no dropout, untied head).
struct TransformerShape {
  std::string name;
  int64_t layers = 0, hidden = 0, heads = 0;
  int64_t kv_heads = 0;  // 0: heads (no grouped-query attention)
  int64_t ffn = 0;       // 0: 4 x hidden
  int64_t vocab = 0, seq_len = 0;
  bool llama_style = false;
  bool flash_attention = false;  // the attention core keeps no s x s scores
  int64_t published_batch = 0;   // the global batch of its published runs (a default; 0: none)
  int64_t Ffn() const { return ffn > 0 ? ffn : 4 * hidden; }
  int64_t KvHeads() const { return kv_heads > 0 ? kv_heads : heads; }
  int64_t LayerParameters() const;
  // Of a layer's parameters, those Megatron-LM's tensor slicing splits over the tensor ranks
  // (the matrices, the column-parallel biases) and those every rank keeps (norms, the row-
  // parallel biases): LayerParameters() = split + replicated.
  int64_t LayerSplitParameters() const;
  int64_t LayerReplicatedParameters() const { return LayerParameters() - LayerSplitParameters(); }
  // Whether the layers split over t tensor ranks (t divides the heads, the KV heads, the MLP).
  bool SplitsOver(int t) const;
  int64_t EmbeddingParameters() const;  // token (+ position) embedding
  int64_t HeadParameters() const;       // the final norm, and the classifier unless tied
  int64_t Parameters() const;
  // Per sequence of seq_len tokens: a layer's forward multiply-adds x 2 (matrix multiplies and
  // the attention core) and the classifier's.
  double LayerForwardFlops() const;
  double HeadForwardFlops() const;
  // Per sequence and tensor rank of t: the bytes a layer's forward reads and writes in its
  // element-wise ops, and the bytes its saved activations take until its backward (no
  // recompute). Under tensor slicing the norms, residuals and the dropouts after the two
  // row-parallel linears run on every rank, the rest on the rank's heads and MLP columns
  // (Korthikanti et al.'s s b h (10 + 24/t + 5 a s / (h t)) for GPT).
  // With `sequence_sharded` (Megatron-LM's sequence parallelism), the replicated part is 1/t too:
  // s b h (34 + 5 a s / h) / t for GPT.
  double LayerForwardTrafficBytes(int t = 1, bool sequence_sharded = false) const;
  double LayerActivationBytes(int t = 1, bool sequence_sharded = false) const;
  // Named shapes: "gpt3-175b" (Brown et al.), "megatron-76b" (Narayanan et al. 2021, Table 1's
  // 76.1B row), "llama2-70b" (Touvron et al. 2023), "gpt2-1.5b"; NotFound listing them otherwise.
  static Result<TransformerShape> Preset(std::string_view name);
  Status Validate() const;
};

// Megatron-LM's count of a training step's FLOPs (Narayanan et al. 2021, eq. 3: 96 B s l h^2
// (1 + s / 6h + V / 16 l h), which counts every layer's forward twice: activation recompute),
// and the model's own (3 x the forward: no recompute), for `batch` sequences.
double MegatronStepFlops(const TransformerShape& shape, int64_t batch);
double ModelStepFlops(const TransformerShape& shape, int64_t batch);

struct ScaleTraining {
  int64_t global_batch = 0;  // sequences per step
  // Bytes per parameter: weights and gradients as the GPUs hold them, and the optimizer's (fp32
  // master weights and Adam's two moments).
  double weight_bytes = 2, gradient_bytes = 2, optimizer_bytes = 12;
  // Whether collectives run beside the compute (Tessera's runtime: a lane per channel) or
  // between it (a runtime that waits for each gather and reduction).
  bool overlap_communication = true;
  // Under tensor parallelism, whether the embedding and the classifier split over the tensor
  // ranks by vocabulary where T divides the vocabulary (Megatron-LM's vocabulary-parallel
  // embedding and cross-entropy; Tessera's runtime's rule, model/gpt2.cc) or run whole on every
  // rank (false, and where T does not divide it).
  bool vocab_parallel = true;
};

enum class RankLayout : uint8_t {
  kStagesInNode,    // rank = replica x P + stage: a pipeline's neighbours share a node
  kReplicasInNode,  // rank = stage x D + replica: a stage's data-parallel ranks share a node
};
const char* RankLayoutName(RankLayout layout);

struct ScaleSpace {
  std::vector<int> gpus;  // GPU counts to plan for (empty: the whole cluster)
  // Tensor-parallel degrees T; a degree is planned where it splits the layers and its ranks fit
  // in one node (its all-reduces on NVLink, as Megatron-LM places them).
  std::vector<int> tensor_parallel = {1, 2, 4, 8};
  // With T > 1: whether the tensor ranks also shard the sequence (Megatron-LM's sequence
  // parallelism), planned where the runtime runs it (T divides the vocabulary and the sequence).
  std::vector<bool> shard_sequence = {false, true};
  std::vector<int> zero_stages = {0, 1, 2, 3};
  std::vector<PipelineSchedule> schedules = {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B,
                                             PipelineSchedule::kInterleaved,
                                             PipelineSchedule::kZbH1};
  std::vector<int> micro_batch_sizes = {1, 2, 4, 8};
  bool offload = true;           // also plans with the optimizer on the host
  int max_micro_batches = 1024;  // per step and replica
};

// A candidate's time and memory, term by term (per GPU of the slowest / largest stage).
struct ScaleCosts {
  double forward_ms = 0, backward_ms = 0;  // one micro-batch through the slowest chunk
  double p2p_ms = 0;                       // one activation (or its gradient) to the next stage
  double pipeline_ms = 0;                  // the schedule's simulated makespan
  double bubble = 0;                       // its idle fraction
  double data_parallel_ms = 0;             // the exposed data-parallel communication
  double optimizer_ms = 0;
  double model_state_gib = 0, activation_gib = 0, working_gib = 0;
  int peak_in_flight = 0;  // micro-batch chunks a stage holds at once
};

struct ScalePlan {
  PlanChoice choice;
  int micro_batch_size = 1;
  RankLayout layout = RankLayout::kStagesInNode;
  int recomputed_layers = 0;  // per stage (of layers_per_stage)
  int layers_per_stage = 0;   // the largest stage's
  double step_ms = 0;
  double peak_gib = 0;
  Bottleneck bottleneck = Bottleneck::kCompute;
  ScaleCosts costs;
  // Per GPU: the model's FLOPs (3 x forward) and Megatron-LM's count (eq. 3; 0 for Llama-style
  // shapes, which its formula does not describe) over the step time.
  double model_tflops = 0, megatron_tflops = 0;
  // "D16 x P64 1f1b M96 ZeRO-1 b1, recompute 1/2, stages-in-node"
  std::string Name() const;
};

struct ScaleRefusal {
  ScalePlan plan;      // its dimensions
  std::string reason;  // the plan with its recompute, and what it needs
  // Per GPU, how far over it stays with every layer recomputed (GPU memory), or its share of
  // its node's excess (host memory, with the optimizer offloaded).
  double shortfall_gib = 0;
};

struct ScaleSearchResult {
  int gpus = 0;
  std::vector<ScalePlan> ranked;  // best first
  std::vector<ScaleRefusal> refused;
  int considered = 0;
  double search_ms = 0;
};

// The predicted costs of one plan (no search): InvalidArgument for dimensions that do not fit
// the cluster, the model or the batch (named); Infeasible, with the shortfall, when it cannot
// fit in memory with every layer recomputed.
Result<ScalePlan> EvaluateScalePlan(const DescribedCluster& cluster, const TransformerShape& shape,
                                    const ScaleTraining& training, const PlanChoice& choice,
                                    int micro_batch_size, RankLayout layout);

// The ranked plans per GPU count of the space (each count's plans over that many GPUs of the
// cluster). Infeasible when nothing fits at some count, naming the closest plan and its
// shortfall and what would fix it; InvalidArgument for a bad cluster, shape, batch or space.
Result<std::vector<ScaleSearchResult>> SearchAtScale(const DescribedCluster& cluster,
                                                     const TransformerShape& shape,
                                                     const ScaleTraining& training,
                                                     const ScaleSpace& space);

// The table `tessera plan --cluster` prints: the top plans with step time, TFLOP/s per GPU by
// both counts, peak memory, bubble and bottleneck.
std::string DescribeScaleSearch(const ScaleSearchResult& result, int top);

}  // namespace tessera
