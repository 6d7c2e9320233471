// Pipeline schedules as task order.
//
// Letters (planner/training_plan.h's names): P pipeline stages, V virtual stages per stage,
// M micro-batches per step.
//
// A pipeline plan cuts the model's layers into P x V contiguous chunks; chunk c runs on stage
// (worker group) c % P as its virtual stage c / P (V = 1 but for interleaved 1F1B). Each stage
// runs, per micro-batch m and chunk, a forward op F (the forwards of the chunk's layers) and a
// backward op B (their backwards, last layer first); zero-bubble schedules split B into B (the
// input gradients, on the critical path) and W (the weight gradients, which can wait).
//
// A schedule is nothing but the order of these ops on each stage. ScheduleOrder computes it;
// the planner's schedule pass (planner/schedule_pass.cc) chains each stage's tasks in that order
// with control edges, and the runtime runs whatever order the plan gives.
//
//   gpipe        F(0..M-1), then B(0..M-1): M micro-batches' activations live at once.
//   1f1b         P-s-1 warm-up forwards, then F and B alternate, then the remaining B: at most
//                P-s micro-batches in flight on stage s.
//   interleaved  1F1B over V chunks per stage (Megatron-LM's order; M a multiple of P): the
//                bubble shrinks by V at the cost of V times the point-to-point traffic.
//   zb-h1        1F1B's forwards and input-gradient backwards, each W deferred while F or B
//                work is ready and run in what would be bubbles; no stage holds more than P
//                micro-batches' activations (1F1B's peak; a W reads what its F saved), or P + 1
//                where that shortens the step (Qi et al., "Zero Bubble Pipeline Parallelism", the
//                H1 schedule). The order is the one a list schedule makes with the costs of F, B
//                and W (unit costs: the textbook).
//
// SimulateSchedule runs per-stage orders with fixed op costs (F, B, W) and dependencies
// F(c, m) after F(c-1, m), B(c, m) after B(c+1, m) (or F(c, m) for the last chunk), W(c, m)
// after B(c, m): the makespan and the bubble (idle fraction) that the order allows, used by
// the tests and as the benchmark's theory column.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace tessera {

enum class PipelineSchedule : uint8_t { kGPipe, k1F1B, kInterleaved, kZbH1 };

const char* ScheduleName(PipelineSchedule schedule);
// "gpipe" | "1f1b" | "interleaved" | "zb-h1"; InvalidArgument naming the choices otherwise.
Result<PipelineSchedule> ParseSchedule(std::string_view text);
// Whether the schedule splits the backward into B and W.
inline bool SplitsBackward(PipelineSchedule schedule) {
  return schedule == PipelineSchedule::kZbH1;
}

struct PipelineOp {
  enum class Kind : uint8_t { kForward, kBackward, kWeight };  // F, B (input grads; all if no W), W
  Kind kind = Kind::kForward;
  int chunk = 0;  // the model chunk (0 .. P*V-1): virtual stage chunk / P of stage chunk % P
  int micro = 0;  // the micro-batch
  friend bool operator==(const PipelineOp&, const PipelineOp&) = default;
};

std::string ToString(const PipelineOp& op);  // "F3", "B0", "W2"; with V > 1: "F3.1" (chunk 1)

// InvalidArgument naming what to change: P, M or V < 1, V > 1 without interleaved (or
// interleaved without V > 1), M < P for 1F1B-like schedules, M not a multiple of P for
// interleaved.
Status CheckSchedule(PipelineSchedule schedule, int stages, int micro_batches, int virtual_stages);

struct OpCosts {
  double forward = 1, backward = 2, weight = 0;  // B + W when split (weight > 0)
};

// Per stage, the order of its ops. ZB-H1's order is a list schedule over the costs of one
// chunk's F, B (the input half) and W (unit costs unless all three are positive; the planner
// passes the op cost model's). REQUIRES: CheckSchedule passed.
std::vector<std::vector<PipelineOp>> ScheduleOrder(PipelineSchedule schedule, int stages,
                                                   int micro_batches, int virtual_stages,
                                                   OpCosts zero_bubble_costs = {1, 1, 1});

struct ScheduleSimulation {
  double makespan = 0;
  double bubble = 0;  // idle time over stages x makespan
  // Per stage: the most micro-batches whose activations it held at once (after F, until the
  // last of B / W that reads them), and when its last op ended.
  std::vector<int> peak_in_flight;
  std::vector<double> stage_end;
};

// InvalidArgument if the orders deadlock (an op waits for one that comes later on its stage).
Result<ScheduleSimulation> SimulateSchedule(const std::vector<std::vector<PipelineOp>>& orders,
                                            int stages, int virtual_stages, int micro_batches,
                                            OpCosts costs);

// As above with each chunk's own costs (chunk_costs[c] for chunk c, not scaled by V): chunks
// holding more layers, or the embedding or the head, take longer. InvalidArgument also when
// chunk_costs does not hold stages x virtual_stages entries.
Result<ScheduleSimulation> SimulateSchedule(const std::vector<std::vector<PipelineOp>>& orders,
                                            int stages, int virtual_stages, int micro_batches,
                                            const std::vector<OpCosts>& chunk_costs);

// Per stage, the most micro-batches whose activations it holds at once (ScheduleSimulation's
// peak_in_flight): from F until B reads them, or W with `split_backward`. A property of the order
// alone, whatever the costs.
std::vector<int> PeakInFlight(const std::vector<std::vector<PipelineOp>>& orders,
                              bool split_backward);

// The textbook bubble: (P-1)/(M+P-1) for GPipe and 1F1B, that over V for interleaved, and
// (P-1)/(3M+P-1) for ZB-H1 (F = B = W: a third of 1F1B's bubble time).
double TheoreticalBubble(PipelineSchedule schedule, int stages, int micro_batches,
                         int virtual_stages);

}  // namespace tessera
