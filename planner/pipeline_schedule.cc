#include "planner/pipeline_schedule.h"

#include <algorithm>
#include <limits>

#include <fmt/format.h>

namespace tessera {

namespace {

using Kind = PipelineOp::Kind;

PipelineOp F(int chunk, int micro) { return {Kind::kForward, chunk, micro}; }
PipelineOp B(int chunk, int micro) { return {Kind::kBackward, chunk, micro}; }
PipelineOp W(int chunk, int micro) { return {Kind::kWeight, chunk, micro}; }

// 1F1B over one chunk per stage.
std::vector<PipelineOp> OneFOneB(int stage, int stages, int micro_batches) {
  std::vector<PipelineOp> order;
  order.reserve(2 * static_cast<size_t>(micro_batches));  // a forward and a backward each
  const int warmup = std::min(stages - stage - 1, micro_batches);
  for (int m = 0; m < warmup; ++m) order.push_back(F(stage, m));
  for (int i = 0; i + warmup < micro_batches; ++i) {
    order.push_back(F(stage, warmup + i));
    order.push_back(B(stage, i));
  }
  for (int m = micro_batches - warmup; m < micro_batches; ++m) order.push_back(B(stage, m));
  return order;
}

// Megatron-LM's interleaved 1F1B: the k-th forward of a stage is micro-batch
// (k / (P V)) P + k % P of its virtual stage (k / P) % V; backwards go through the virtual
// stages in reverse.
std::vector<PipelineOp> Interleaved(int stage, int stages, int micro_batches, int virtual_stages) {
  const int total = micro_batches * virtual_stages;
  auto micro = [&](int k) { return (k / (stages * virtual_stages)) * stages + k % stages; };
  auto forward = [&](int k) {
    return F(((k / stages) % virtual_stages) * stages + stage, micro(k));
  };
  auto backward = [&](int k) {
    return B((virtual_stages - 1 - (k / stages) % virtual_stages) * stages + stage, micro(k));
  };
  const int warmup = std::min((stages - stage - 1) * 2 + (virtual_stages - 1) * stages, total);
  std::vector<PipelineOp> order;
  order.reserve(2 * static_cast<size_t>(total));
  for (int k = 0; k < warmup; ++k) order.push_back(forward(k));
  for (int i = 0; i + warmup < total; ++i) {
    order.push_back(forward(warmup + i));
    order.push_back(backward(i));
  }
  for (int k = total - warmup; k < total; ++k) order.push_back(backward(k));
  return order;
}

// ZB-H1 by list scheduling with costs F, B and W (event-driven): a stage that is free runs a
// ready B first, else its next F while fewer than P - s micro-batches are between F and B
// (1F1B's bound) and fewer than `in_flight` between F and W (the activations it holds), else its
// oldest pending W; with nothing to run it waits for the next op to end anywhere.
std::vector<std::vector<PipelineOp>> ListScheduleZeroBubble(int stages, int micro_batches,
                                                            OpCosts costs, int in_flight) {
  std::vector<std::vector<PipelineOp>> orders(static_cast<size_t>(stages));
  constexpr double kNever = std::numeric_limits<double>::infinity();
  const size_t p = static_cast<size_t>(stages), m = static_cast<size_t>(micro_batches);
  // End times per (stage, micro); kNever until scheduled.
  std::vector<std::vector<double>> f_end(p, std::vector<double>(m, kNever));
  std::vector<std::vector<double>> b_end = f_end;
  std::vector<int> next_f(p, 0), next_b(p, 0), next_w(p, 0);
  std::vector<double> free_at(p, 0.0);  // when each stage's last op ends
  int done = 0;
  const int total = stages * micro_batches * 3;
  while (done < total) {
    double now = kNever;
    for (size_t s = 0; s < p; ++s) {
      if (next_w[s] < micro_batches) now = std::min(now, free_at[s]);
    }
    bool progressed = false;
    for (int s = 0; s < stages; ++s) {
      const size_t i = static_cast<size_t>(s);
      if (next_w[i] >= micro_batches || free_at[i] > now) continue;
      const int b = next_b[i], f = next_f[i];
      const bool b_ready = b < micro_batches && b < f &&
                           (s == stages - 1 ? f_end[i][static_cast<size_t>(b)]
                                            : b_end[i + 1][static_cast<size_t>(b)]) <= now;
      const bool f_ready = f < micro_batches && f - b < stages - s && f - next_w[i] < in_flight &&
                           (s == 0 || f_end[i - 1][static_cast<size_t>(f)] <= now);
      auto& order = orders[i];
      double cost = 0;
      if (b_ready) {
        order.push_back(B(s, b));
        cost = costs.backward;
        b_end[i][static_cast<size_t>(b)] = now + cost;
        ++next_b[i];
      } else if (f_ready) {
        order.push_back(F(s, f));
        cost = costs.forward;
        f_end[i][static_cast<size_t>(f)] = now + cost;
        ++next_f[i];
      } else if (next_w[i] < next_b[i]) {
        order.push_back(W(s, next_w[i]++));
        cost = costs.weight;
      } else {
        continue;
      }
      free_at[i] = now + cost;
      progressed = true;
      ++done;
    }
    if (progressed) continue;
    // Nothing could start now: the stages that are free wait for the next op to end (a busy
    // stage's last op).
    double next = kNever;
    for (double end : free_at) {
      if (end > now) next = std::min(next, end);
    }
    if (next == kNever) break;  // cannot happen for a feasible order; never loop forever
    for (size_t s = 0; s < p; ++s) {
      if (free_at[s] <= now) free_at[s] = next;
    }
  }
  return orders;
}

// ZB-H1: the list schedule holding at most P micro-batches' activations per stage (1F1B's peak,
// as the paper's ZB-H1), unless holding P + 1 shortens the step for these costs. With F = B = W
// this reaches the ZB-H1 bubble, (P-1)/(3M+P-1), for P up to 4 (P = 2 within 1F1B's memory);
// with other costs it fills the bubbles those costs leave.
std::vector<std::vector<PipelineOp>> ZeroBubbleH1(int stages, int micro_batches, OpCosts costs) {
  if (!(costs.forward > 0 && costs.backward > 0 && costs.weight > 0)) costs = {1, 1, 1};
  auto tight = ListScheduleZeroBubble(stages, micro_batches, costs, stages);
  auto loose = ListScheduleZeroBubble(stages, micro_batches, costs, stages + 1);
  const Result<ScheduleSimulation> tight_sim =
      SimulateSchedule(tight, stages, 1, micro_batches, costs);
  const Result<ScheduleSimulation> loose_sim =
      SimulateSchedule(loose, stages, 1, micro_batches, costs);
  if (!loose_sim.ok()) return tight;
  if (!tight_sim.ok()) return loose;
  return tight_sim->makespan <= loose_sim->makespan * (1 + 1e-9) ? tight : loose;
}

}  // namespace

const char* ScheduleName(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::kGPipe:
      return "gpipe";
    case PipelineSchedule::k1F1B:
      return "1f1b";
    case PipelineSchedule::kInterleaved:
      return "interleaved";
    case PipelineSchedule::kZbH1:
      return "zb-h1";
  }
  return "?";
}

Result<PipelineSchedule> ParseSchedule(std::string_view text) {
  for (PipelineSchedule schedule : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B,
                                    PipelineSchedule::kInterleaved, PipelineSchedule::kZbH1}) {
    if (text == ScheduleName(schedule)) return schedule;
  }
  return InvalidArgument("schedule '{}' is not one of: gpipe, 1f1b, interleaved, zb-h1", text);
}

std::string ToString(const PipelineOp& op) {
  const char kind = op.kind == Kind::kForward ? 'F' : op.kind == Kind::kBackward ? 'B' : 'W';
  return fmt::format("{}{}(c{})", kind, op.micro, op.chunk);
}

Status CheckSchedule(PipelineSchedule schedule, int stages, int micro_batches, int virtual_stages) {
  if (stages < 1) return InvalidArgument("pipeline stages must be >= 1, got {}", stages);
  if (micro_batches < 1) {
    return InvalidArgument("micro-batches must be >= 1, got {}", micro_batches);
  }
  if (virtual_stages < 1) {
    return InvalidArgument("virtual stages must be >= 1, got {}", virtual_stages);
  }
  const bool interleaved = schedule == PipelineSchedule::kInterleaved;
  if (virtual_stages > 1 && !interleaved) {
    return InvalidArgument(
        "--virtual-stages {} needs --schedule interleaved (schedule {} runs one chunk per stage)",
        virtual_stages, ScheduleName(schedule));
  }
  if (interleaved && virtual_stages < 2) {
    return InvalidArgument(
        "the interleaved schedule needs --virtual-stages V >= 2 (chunks per stage); with V = 1 it "
        "is 1f1b");
  }
  if (schedule != PipelineSchedule::kGPipe && micro_batches < stages) {
    return InvalidArgument(
        "schedule {} needs at least as many micro-batches as pipeline stages ({} < {}): use "
        "--micro-batches {} or more, or --schedule gpipe",
        ScheduleName(schedule), micro_batches, stages, stages);
  }
  if (interleaved && micro_batches % stages != 0) {
    return InvalidArgument(
        "the interleaved schedule runs micro-batches in groups of the {} stages: use a multiple "
        "of {} micro-batches (got {})",
        stages, stages, micro_batches);
  }
  return Status::Ok();
}

std::vector<std::vector<PipelineOp>> ScheduleOrder(PipelineSchedule schedule, int stages,
                                                   int micro_batches, int virtual_stages,
                                                   OpCosts zero_bubble_costs) {
  if (schedule == PipelineSchedule::kZbH1) {
    return ZeroBubbleH1(stages, micro_batches, zero_bubble_costs);
  }
  std::vector<std::vector<PipelineOp>> orders;
  for (int s = 0; s < stages; ++s) {
    std::vector<PipelineOp> order;
    switch (schedule) {
      case PipelineSchedule::kGPipe:
        for (int m = 0; m < micro_batches; ++m) order.push_back(F(s, m));
        for (int m = 0; m < micro_batches; ++m) order.push_back(B(s, m));
        break;
      case PipelineSchedule::k1F1B:
        order = OneFOneB(s, stages, micro_batches);
        break;
      case PipelineSchedule::kInterleaved:
        order = Interleaved(s, stages, micro_batches, virtual_stages);
        break;
      case PipelineSchedule::kZbH1:
        break;
    }
    orders.push_back(std::move(order));
  }
  return orders;
}

Result<ScheduleSimulation> SimulateSchedule(const std::vector<std::vector<PipelineOp>>& orders,
                                            int stages, int virtual_stages, int micro_batches,
                                            OpCosts costs) {
  // A chunk is 1/V of a stage's layers.
  const double scale = 1.0 / virtual_stages;
  const OpCosts chunk{costs.forward * scale, costs.backward * scale, costs.weight * scale};
  return SimulateSchedule(
      orders, stages, virtual_stages, micro_batches,
      std::vector<OpCosts>(static_cast<size_t>(stages * virtual_stages), chunk));
}

Result<ScheduleSimulation> SimulateSchedule(const std::vector<std::vector<PipelineOp>>& orders,
                                            int stages, int virtual_stages, int micro_batches,
                                            const std::vector<OpCosts>& chunk_costs) {
  const int chunks = stages * virtual_stages;
  if (chunk_costs.size() != static_cast<size_t>(chunks)) {
    return InvalidArgument("schedule simulation: {} chunk costs for {} stages x {} virtual stages",
                           chunk_costs.size(), stages, virtual_stages);
  }
  constexpr double kNotYet = -1;
  auto index = [&](int chunk, int micro) {
    return static_cast<size_t>(chunk) * static_cast<size_t>(micro_batches) +
           static_cast<size_t>(micro);
  };
  const size_t n = static_cast<size_t>(chunks) * static_cast<size_t>(micro_batches);
  std::vector<double> f_end(n, kNotYet), b_end(n, kNotYet), w_end(n, kNotYet);
  const bool split = std::any_of(chunk_costs.begin(), chunk_costs.end(),
                                 [](const OpCosts& c) { return c.weight > 0; });
  std::vector<size_t> next(orders.size(), 0);
  std::vector<double> free_at(orders.size(), 0), busy(orders.size(), 0);
  ScheduleSimulation result;
  result.peak_in_flight.assign(orders.size(), 0);
  std::vector<int> in_flight(orders.size(), 0);
  bool progress = true;
  while (progress) {
    progress = false;
    for (size_t s = 0; s < orders.size(); ++s) {
      while (next[s] < orders[s].size()) {
        const PipelineOp& op = orders[s][next[s]];
        const size_t i = index(op.chunk, op.micro);
        const OpCosts& costs = chunk_costs[static_cast<size_t>(op.chunk)];
        double ready = 0, cost = 0;
        switch (op.kind) {
          case Kind::kForward:
            ready = op.chunk == 0 ? 0 : f_end[index(op.chunk - 1, op.micro)];
            cost = costs.forward;
            break;
          case Kind::kBackward:
            ready = op.chunk == chunks - 1 ? f_end[i] : b_end[index(op.chunk + 1, op.micro)];
            if (f_end[i] == kNotYet) ready = kNotYet;
            cost = costs.backward;
            break;
          case Kind::kWeight:
            ready = b_end[i];
            cost = costs.weight;
            break;
        }
        if (ready == kNotYet) break;
        const double start = std::max(ready, free_at[s]);
        const double end = start + cost;
        (op.kind == Kind::kForward ? f_end : op.kind == Kind::kBackward ? b_end : w_end)[i] = end;
        free_at[s] = end;
        busy[s] += cost;
        // Activations live from F until the last op that reads them (W if split, else B).
        if (op.kind == Kind::kForward) {
          result.peak_in_flight[s] = std::max(result.peak_in_flight[s], ++in_flight[s]);
        } else if ((op.kind == Kind::kWeight) == split) {
          --in_flight[s];
        }
        ++next[s];
        progress = true;
      }
    }
  }
  double total_busy = 0;
  for (size_t s = 0; s < orders.size(); ++s) {
    if (next[s] != orders[s].size()) {
      return InvalidArgument("schedule deadlocks: stage {} waits at {}", s,
                             ToString(orders[s][next[s]]));
    }
    result.makespan = std::max(result.makespan, free_at[s]);
    result.stage_end.push_back(free_at[s]);
    total_busy += busy[s];
  }
  result.bubble = result.makespan > 0
                      ? 1.0 - total_busy / (result.makespan * static_cast<double>(orders.size()))
                      : 0;
  return result;
}

double TheoreticalBubble(PipelineSchedule schedule, int stages, int micro_batches,
                         int virtual_stages) {
  const double p1 = stages - 1;
  switch (schedule) {
    case PipelineSchedule::kGPipe:
    case PipelineSchedule::k1F1B:
      return p1 / (micro_batches + p1);
    case PipelineSchedule::kInterleaved:
      return p1 / (static_cast<double>(virtual_stages) * micro_batches + p1);
    case PipelineSchedule::kZbH1:
      return p1 / (3.0 * micro_batches + p1);
  }
  return 0;
}

}  // namespace tessera
