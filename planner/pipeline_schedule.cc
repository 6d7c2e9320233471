#include "planner/pipeline_schedule.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <queue>
#include <utility>

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
// oldest pending W; with nothing to run it waits until an op ends that it waits for.
//
// Events are (time, stage) to look at, earliest first: a stage when its own op ends, and a
// stage with nothing to run when the neighbour's op it waits for ends (an F for the next
// stage's F, a B for the previous stage's B); nothing else can make it ready (its other
// conditions are its own counts). Decisions at one time are independent of each other (every op
// takes time, so nothing that starts now ends now), so the order is the same as looking at every
// free stage at every op's end, in O(ops log P) instead of O(ops P) (the search at scale runs
// this for thousands of plans of up to 96 stages and 1536 micro-batches).
std::vector<std::vector<PipelineOp>> ListScheduleZeroBubble(int stages, int micro_batches,
                                                            OpCosts costs, int in_flight) {
  std::vector<std::vector<PipelineOp>> orders(static_cast<size_t>(stages));
  for (auto& order : orders) order.reserve(3 * static_cast<size_t>(micro_batches));
  constexpr double kNever = std::numeric_limits<double>::infinity();
  const size_t p = static_cast<size_t>(stages), m = static_cast<size_t>(micro_batches);
  // End times per (stage, micro), stage-major; kNever until scheduled.
  std::vector<double> f_end(p * m, kNever), b_end(p * m, kNever);
  std::vector<int> next_f(p, 0), next_b(p, 0), next_w(p, 0);
  std::vector<double> free_at(p, 0.0);  // when each stage's last op ends
  // A stage with nothing to run waits for the end of the op that makes its B or F ready: at a
  // time known already, an event; else it is marked, and the neighbour that starts that op
  // adds an event at its end.
  std::vector<char> waiting(p, 0);
  using Event = std::pair<double, int>;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events;
  for (int s = 0; s < stages; ++s) events.emplace(0.0, s);
  while (!events.empty()) {
    const auto [now, s] = events.top();
    events.pop();
    const size_t i = static_cast<size_t>(s);
    // Done, or busy until an event of its own.
    if (next_w[i] >= micro_batches || free_at[i] > now) continue;
    waiting[i] = 0;
    const int b = next_b[i], f = next_f[i];
    // When what B and F wait for ends (kNever: not started; 0: nothing to wait for), if their
    // stage's own counts let them run.
    const bool b_may = b < micro_batches && b < f;
    const double b_after = !b_may            ? kNever
                           : s == stages - 1 ? f_end[i * m + static_cast<size_t>(b)]
                                             : b_end[(i + 1) * m + static_cast<size_t>(b)];
    const bool f_may = f < micro_batches && f - b < stages - s && f - next_w[i] < in_flight;
    const double f_after = !f_may   ? kNever
                           : s == 0 ? 0
                                    : f_end[(i - 1) * m + static_cast<size_t>(f)];
    auto& order = orders[i];
    double end = now;
    if (b_may && b_after <= now) {
      order.push_back(B(s, b));
      end += costs.backward;
      b_end[i * m + static_cast<size_t>(b)] = end;
      ++next_b[i];
      if (s > 0 && waiting[i - 1]) events.emplace(end, s - 1);
    } else if (f_may && f_after <= now) {
      order.push_back(F(s, f));
      end += costs.forward;
      f_end[i * m + static_cast<size_t>(f)] = end;
      ++next_f[i];
      if (s < stages - 1 && waiting[i + 1]) events.emplace(end, s + 1);
    } else if (next_w[i] < next_b[i]) {
      order.push_back(W(s, next_w[i]++));
      end += costs.weight;
    } else {
      // Nothing to run: wake when B or F can (their counts cannot change meanwhile).
      const double wake = std::min(b_after, f_after);
      if (wake < kNever) events.emplace(wake, s);
      if ((b_may && b_after == kNever) || (f_may && f_after == kNever)) waiting[i] = 1;
      continue;
    }
    free_at[i] = end;
    events.emplace(end, s);
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
  std::vector<double> f_end(n, kNotYet), b_end(n, kNotYet);
  const bool split = std::any_of(chunk_costs.begin(), chunk_costs.end(),
                                 [](const OpCosts& c) { return c.weight > 0; });
  std::vector<size_t> next(orders.size(), 0);
  std::vector<double> free_at(orders.size(), 0), busy(orders.size(), 0);
  // An op starts when the op it depends on has ended and its stage is free, so every end time
  // is fixed by the orders alone, whatever order the stages are advanced in. Each stage runs
  // until an op's dependency has no end yet, and waits on that (F or B, chunk, micro) until the
  // stage running it records the end: every op is looked at a bounded number of times. The
  // stages waiting on one op form a list: waiting_on_*[op] is the first, next_waiter[s] the next.
  std::vector<int> waiting_on_f(n, -1), waiting_on_b(n, -1), next_waiter(orders.size(), -1);
  std::vector<int> runnable(orders.size());
  for (size_t s = 0; s < orders.size(); ++s) runnable[s] = static_cast<int>(orders.size() - 1 - s);
  auto finished = [&](std::vector<double>& ends, std::vector<int>& waiting, size_t i, double end) {
    ends[i] = end;
    for (int w = std::exchange(waiting[i], -1); w >= 0; w = next_waiter[static_cast<size_t>(w)]) {
      runnable.push_back(w);
    }
  };
  while (!runnable.empty()) {
    const size_t s = static_cast<size_t>(runnable.back());
    runnable.pop_back();
    while (next[s] < orders[s].size()) {
      const PipelineOp& op = orders[s][next[s]];
      const size_t i = index(op.chunk, op.micro);
      const OpCosts& costs = chunk_costs[static_cast<size_t>(op.chunk)];
      // The end this op waits for: (ends, waiters, index) of the op it depends on.
      double ready = 0, cost = 0;
      std::vector<int>* waiters = nullptr;
      size_t dependency = 0;
      switch (op.kind) {
        case Kind::kForward:
          if (op.chunk > 0) {
            dependency = index(op.chunk - 1, op.micro);
            ready = f_end[dependency];
            waiters = &waiting_on_f;
          }
          cost = costs.forward;
          break;
        case Kind::kBackward:
          if (f_end[i] == kNotYet || op.chunk == chunks - 1) {
            dependency = i;
            ready = f_end[i];
            waiters = &waiting_on_f;
          } else {
            dependency = index(op.chunk + 1, op.micro);
            ready = b_end[dependency];
            waiters = &waiting_on_b;
          }
          cost = costs.backward;
          break;
        case Kind::kWeight:
          dependency = i;
          ready = b_end[i];
          waiters = &waiting_on_b;
          cost = costs.weight;
          break;
      }
      if (ready == kNotYet) {
        next_waiter[s] = (*waiters)[dependency];
        (*waiters)[dependency] = static_cast<int>(s);
        break;
      }
      const double end = std::max(ready, free_at[s]) + cost;
      if (op.kind == Kind::kForward) finished(f_end, waiting_on_f, i, end);
      if (op.kind == Kind::kBackward) finished(b_end, waiting_on_b, i, end);
      free_at[s] = end;
      busy[s] += cost;
      ++next[s];
    }
  }
  ScheduleSimulation result;
  result.peak_in_flight = PeakInFlight(orders, split);
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

std::vector<int> PeakInFlight(const std::vector<std::vector<PipelineOp>>& orders,
                              bool split_backward) {
  std::vector<int> peaks;
  peaks.reserve(orders.size());
  for (const std::vector<PipelineOp>& order : orders) {
    int in_flight = 0, peak = 0;
    for (const PipelineOp& op : order) {
      if (op.kind == Kind::kForward) {
        peak = std::max(peak, ++in_flight);
      } else if ((op.kind == Kind::kWeight) == split_backward) {
        --in_flight;
      }
    }
    peaks.push_back(peak);
  }
  return peaks;
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
