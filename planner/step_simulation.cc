#include "planner/step_simulation.h"

#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <queue>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "core/collective_task.h"
#include "core/disk_tasks.h"
#include "core/exchange_layout.h"
#include "planner/channel_order.h"

namespace tessera {
namespace {

enum class Lane : uint8_t { kCompute, kCollective, kIo };

// An all-reduce of B bytes over a ring of N moves 2(N-1)/N x B per member; the others less. A
// quantized gather or reduce-scatter (kQuantizeBitsAttr) moves its bits of an f32 element.
double RingTraffic(const TaskSpec& task, int members) {
  if (members <= 1) return 0;
  const std::string_view op = task.op;
  const double share = static_cast<double>(members - 1) / members;
  if (op == "all_reduce") return 2 * share;
  if (op == "broadcast") return 1;
  if (op == "all_to_all") {
    // A halo or a ring's rotation sends x whole to one neighbour; blocks go (N-1)/N to the others.
    const Result<ExchangeLayout> layout = ExchangeLayoutOf(task.attrs);
    if (layout.ok() && (PassesHalo(*layout) || RotatesRing(*layout))) return 1;
    return share;
  }
  if (op == "compressed_all_reduce") return 2 * share / 32;  // a bit an f32 element
  // reduce_scatter, all_gather, all_gather_in_place
  return share * static_cast<double>(task.attrs.GetInt(kQuantizeBitsAttr, 32)) / 32;
}

int64_t LargestTensorBytes(const Graph& graph, const TaskSpec& task) {
  int64_t bytes = 0;
  if (!task.inputs.empty()) bytes = graph.object(task.inputs[0]).meta.bytes();
  if (!task.outputs.empty()) bytes = std::max(bytes, graph.object(task.outputs[0]).meta.bytes());
  return bytes;
}

int64_t OutputBytes(const Graph& graph, const TaskSpec& task) {
  int64_t bytes = 0;
  for (ObjectId output : task.outputs) bytes += graph.object(output).meta.bytes();
  return bytes;
}

// Why a task became ready when it did: the dependency that arrived last.
struct ReadyCause {
  enum class Kind : uint8_t { kNone, kLocal, kRemote, kCollective, kDisk };
  Kind kind = Kind::kNone;
  double producer_end = 0;   // kRemote: when the producer ended (after: the transfer)
  double members_ready = 0;  // kCollective: when its last member was ready (after: its transfer)
};

struct Collective {
  std::vector<size_t> members;
  int channel = 0;
  int64_t id = 0;       // its `collective` attribute
  bool staged = false;  // on tensor parallelism's channel, its group a stage of a pipeline
  // A parameter gather (kGatherChannel) whose members' workers all run collectives on tensor
  // parallelism's channel (tensor ranks, slabs): they meet at every layer, so its members arrive
  // together, and it waits what any collective of its size does, not StepLinks::gather_latency.
  bool aligned = false;
};

class Simulator {
 public:
  Simulator(const Graph& graph, const std::vector<TaskTime>& times, const StepLinks& links,
            double overhead, const ComputeSharing& sharing)
      : graph_(graph), times_(times), links_(links), overhead_(overhead), sharing_(sharing) {}

  Result<SimulatedStep> Run() {
    TESSERA_RETURN_IF_ERROR(Index());
    const size_t n = graph_.tasks().size();
    for (size_t t = 0; t < n; ++t) {
      if (pending_[t] == 0) Ready(t, 0, ReadyCause{});
    }
    Dispatch(0);
    size_t ended = 0;
    double clock = 0;
    constexpr double kNever = std::numeric_limits<double>::infinity();
    while (true) {
      // The next moment something happens: an event, or (sharing the compute) the first of the
      // running compute tasks to finish at the rate they share.
      SharedRates();
      double finish = kNever, least = kNever;
      for (size_t w : running_) {
        least = std::min(least, workers_[w].remaining);
        finish = std::min(finish, clock + workers_[w].remaining / group_rate_[workers_[w].group]);
      }
      for (RunningCollective& c : running_collectives_) {
        c.rate = CollectiveRate(c.collective);
        least = std::min(least, c.remaining);
        finish = std::min(finish, clock + c.remaining / c.rate);
      }
      const double next = std::min(events_.empty() ? kNever : events_.top().first, finish);
      if (next == kNever) break;
      for (size_t w : running_) {
        workers_[w].remaining -= (next - clock) * group_rate_[workers_[w].group];
      }
      for (RunningCollective& c : running_collectives_) c.remaining -= (next - clock) * c.rate;
      clock = next;
      if (finish <= next) {
        const double done = 1e-12 + 1e-9 * least;  // among the first to finish
        for (auto it = running_.begin(); it != running_.end();) {
          Worker& worker = workers_[*it];
          if (worker.remaining > done) {
            ++it;
            continue;
          }
          const size_t task = worker.running;
          end_[task] = clock;
          worker.compute_free = clock;
          worker.last_compute_end = clock;
          worker.figures.compute_ms += clock - start_[task];
          Touch(worker, clock, Lane::kCompute);
          it = running_.erase(it);
          End(task, clock);
          ++ended;
        }
        for (auto it = running_collectives_.begin(); it != running_collectives_.end();) {
          if (it->remaining > done) {
            ++it;
            continue;
          }
          const Collective& collective = collectives_[it->collective];
          it = running_collectives_.erase(it);
          for (size_t m : collective.members) {
            end_[m] = clock;
            Worker& worker = workers_[worker_of_[m]];
            worker.channel_free[static_cast<size_t>(collective.channel)] = clock;
            Touch(worker, clock, Lane::kCollective);
          }
          for (size_t m : collective.members) {
            End(m, clock);
            ++ended;
          }
        }
      }
      while (!events_.empty() && events_.top().first == clock) {
        const size_t task = events_.top().second;
        events_.pop();
        if (task != kWake) {
          End(task, clock);
          ++ended;
        }
      }
      Dispatch(clock);
    }
    if (ended != n) {
      return InvalidArgument(
          "simulating the step: {} of its {} tasks never ran (a cycle, or a collective some "
          "member of which never becomes ready)",
          n - ended, n);
    }
    return Finish();
  }

 private:
  static constexpr size_t kWake = std::numeric_limits<size_t>::max();
  using Event = std::pair<double, size_t>;  // (time, task ending or kWake)

  struct Worker {
    double compute_free = 0;  // when its compute lane is next free
    double io_free = 0;
    std::array<double, kCollectiveChannels> channel_free{};
    double debt = 0;  // compute taken by swap-file copies, charged to the next compute task
    // Sharing the compute: the task its compute lane runs, and the work it has left (ms at the
    // full rate).
    size_t running = 0;
    double remaining = 0;
    size_t group = 0;                             // the cores it shares (group_capacity_)
    std::vector<size_t> ready_compute, ready_io;  // ready (possibly in the future) tasks
    double last_compute_end = 0;
    double end = 0;
    Lane last_lane = Lane::kCompute;
    SimulatedWorker figures;
  };

  Status Index() {
    const size_t n = graph_.tasks().size();
    if (times_.size() != n) {
      return InvalidArgument("simulating the step: {} task times for a graph of {} tasks",
                             times_.size(), n);
    }
    std::unordered_map<WorkerId, size_t> index;
    worker_of_.resize(n);
    lane_.assign(n, Lane::kCompute);
    collective_of_.assign(n, -1);
    std::map<int64_t, size_t> collective_index;
    for (size_t t = 0; t < n; ++t) {
      const TaskSpec& task = graph_.tasks()[t];
      auto [it, added] = index.emplace(task.pinned_worker, workers_.size());
      if (added) {
        workers_.emplace_back();
        workers_.back().figures.worker = task.pinned_worker;
      }
      worker_of_[t] = it->second;
      TESSERA_ASSIGN_OR_RETURN(std::optional<CollectiveMembership> member, CollectiveOf(task));
      if (member.has_value()) {
        lane_[t] = Lane::kCollective;
        auto [c, new_collective] =
            collective_index.emplace(member->collective, collectives_.size());
        if (new_collective) {
          collectives_.push_back(Collective{{}, member->channel, member->collective});
        }
        collectives_[c->second].members.push_back(t);
        collective_of_[t] = static_cast<int64_t>(c->second);
      } else if (times_[t].on_disk || TouchesDisk(graph_, task)) {
        lane_[t] = Lane::kIo;
      }
    }
    MarkStagedGroups();
    GroupWorkers();
    pending_.assign(n, 0);
    dependents_.resize(n);
    for (size_t t = 0; t < n; ++t) {
      const TaskSpec& task = graph_.tasks()[t];
      for (ObjectId input : task.inputs) {
        const TaskId producer = graph_.object(input).producer;
        if (!producer.valid()) continue;
        ++pending_[t];
        dependents_[producer.value() - 1].push_back({t, input});
      }
      for (TaskId earlier : task.after) {
        ++pending_[t];
        dependents_[earlier.value() - 1].push_back({t, ObjectId()});
      }
    }
    avail_.assign(n, 0);
    cause_.assign(n, ReadyCause{});
    start_.assign(n, 0);
    end_.assign(n, 0);
    members_ready_.assign(collectives_.size(), 0);
    arrived_.assign(collectives_.size(), 0);
    TESSERA_ASSIGN_OR_RETURN(channels_, ChannelQueues::Of(graph_));
    return Status::Ok();
  }

  // The groups of workers that run collectives on tensor parallelism's channel together (tensor
  // ranks, slabs) which are a pipeline's stages: a compute task of one reads an object a worker
  // outside the group made. Their collectives are marked staged (StepLinks::staged_latency), and
  // parameter gathers among such workers aligned.
  void MarkStagedGroups() {
    std::vector<size_t> group(workers_.size());
    std::iota(group.begin(), group.end(), size_t{0});
    const auto root = [&group](size_t w) {
      while (group[w] != w) w = group[w] = group[group[w]];
      return w;
    };
    std::vector<bool> grouped(workers_.size(), false);
    for (const Collective& collective : collectives_) {
      if (collective.channel != kTensorChannel) continue;
      const size_t first = root(worker_of_[collective.members.front()]);
      for (size_t member : collective.members) {
        grouped[worker_of_[member]] = true;
        group[root(worker_of_[member])] = first;
      }
    }
    std::vector<bool> staged(workers_.size(), false);
    for (size_t t = 0; t < graph_.tasks().size(); ++t) {
      if (lane_[t] != Lane::kCompute || !grouped[worker_of_[t]]) continue;
      for (ObjectId input : graph_.tasks()[t].inputs) {
        const TaskId producer = graph_.object(input).producer;
        if (!producer.valid()) continue;
        const size_t from = worker_of_[producer.value() - 1];
        if (root(from) != root(worker_of_[t])) staged[root(worker_of_[t])] = true;
      }
    }
    for (Collective& collective : collectives_) {
      collective.staged = collective.channel == kTensorChannel &&
                          staged[root(worker_of_[collective.members.front()])];
      collective.aligned = collective.channel == kGatherChannel &&
                           std::all_of(collective.members.begin(), collective.members.end(),
                                       [&](size_t member) { return grouped[worker_of_[member]]; });
    }
  }

  double BusBandwidth() const {
    const CollectiveLink& link = links_.collective;
    if (!link.measured()) return 0;
    const int group = links_.collective_group;
    const double all_reduce = 2.0 * (group - 1) / group;
    return group > 1 ? link.bytes_per_us * all_reduce : link.bytes_per_us;
  }

  // The time an object of `bytes` takes from its producer's end to a reader on another worker.
  double PushMs(int64_t bytes) const {
    const CollectiveLink& p2p = links_.point_to_point;
    if (p2p.measured()) {
      const double latency =
          links_.shared_push_latency_us > 0 ? links_.shared_push_latency_us : p2p.latency_us;
      return (latency + static_cast<double>(bytes) / p2p.bytes_per_us) / 1e3;
    }
    const double bus = BusBandwidth();
    if (bus <= 0) return 0;
    return (links_.collective.latency_us + static_cast<double>(bytes) / bus) / 1e3;
  }

  double CollectiveMs(const Collective& collective) const {
    const TaskSpec& first = graph_.tasks()[collective.members.front()];
    double compute = 0;
    for (size_t m : collective.members) compute = std::max(compute, times_[m].ms);
    const double bus = BusBandwidth();
    double transfer = 0;
    const int members = static_cast<int>(collective.members.size());
    if (bus > 0 && members > 1) {
      const auto bytes = static_cast<double>(LargestTensorBytes(graph_, first));
      double latency = links_.LatencyUs(members);
      if (collective.channel == kTensorChannel) {
        using Wait = StepLinks::GroupWait;
        Wait wait = Wait::kAllReduce;
        if (first.op == "all_to_all") {
          wait = Wait::kExchange;
        } else if (first.op == "reduce_scatter" || first.op.starts_with("all_gather")) {
          wait = Wait::kSequenceShard;
        }
        latency = links_.GroupWaitUs(wait, members, collective.staged);
      } else if (collective.channel == kGatherChannel && !collective.aligned) {
        latency = links_.GatherLatencyUs(members);
      }
      transfer = (latency + RingTraffic(first, members) * bytes / bus) / 1e3;
    }
    return compute + overhead_ + transfer;
  }

  void Ready(size_t task, double at, const ReadyCause& cause) {
    avail_[task] = at;
    cause_[task] = cause;
    Worker& worker = workers_[worker_of_[task]];
    switch (lane_[task]) {
      case Lane::kCompute:
        worker.ready_compute.push_back(task);
        break;
      case Lane::kIo:
        worker.ready_io.push_back(task);
        break;
      case Lane::kCollective: {
        const auto c = static_cast<size_t>(collective_of_[task]);
        members_ready_[c] = std::max(members_ready_[c], at);
        if (++arrived_[c] == collectives_[c].members.size()) waiting_.push_back(c);
        break;
      }
    }
    events_.emplace(at, kWake);
  }

  void End(size_t task, double now) {
    for (const auto& [dependent, object] : dependents_[task]) {
      double at = now;
      ReadyCause cause;
      const bool remote = worker_of_[dependent] != worker_of_[task];
      if (lane_[task] == Lane::kCollective) {
        cause.kind = ReadyCause::Kind::kCollective;
        cause.members_ready = members_ready_[static_cast<size_t>(collective_of_[task])];
      } else if (lane_[task] == Lane::kIo) {
        cause.kind = ReadyCause::Kind::kDisk;
      } else if (remote) {
        cause.kind = ReadyCause::Kind::kRemote;
        cause.producer_end = now;
      } else {
        cause.kind = ReadyCause::Kind::kLocal;
      }
      if (remote && object.valid()) at += PushMs(graph_.object(object).meta.bytes());
      if (at >= avail_[dependent]) {
        avail_[dependent] = at;
        cause_[dependent] = cause;
      }
      if (--pending_[dependent] == 0) Ready(dependent, avail_[dependent], cause_[dependent]);
    }
  }

  // Puts the idle gap [from, to) of a worker's compute lane down to what `task` waited for.
  void ChargeGap(Worker& worker, double from, double to, const ReadyCause& cause) {
    if (to <= from) return;
    SimulatedWorker& f = worker.figures;
    switch (cause.kind) {
      case ReadyCause::Kind::kRemote: {
        const double split = std::clamp(cause.producer_end, from, to);
        f.bubble_ms += split - from;
        f.communication_ms += to - split;
        break;
      }
      case ReadyCause::Kind::kCollective: {
        const double split = std::clamp(cause.members_ready, from, to);
        f.bubble_ms += split - from;
        f.communication_ms += to - split;
        break;
      }
      case ReadyCause::Kind::kDisk:
        f.swap_ms += to - from;
        break;
      case ReadyCause::Kind::kNone:
      case ReadyCause::Kind::kLocal:
        f.bubble_ms += to - from;  // not expected: its own lane's work would have kept it busy
        break;
    }
  }

  void Start(size_t task, double now, double duration) {
    start_[task] = now;
    end_[task] = now + duration;
    events_.emplace(now + duration, task);
  }

  void Dispatch(double now) {
    for (Worker& worker : workers_) {
      if (worker.compute_free <= now) {
        auto best = worker.ready_compute.end();
        for (auto it = worker.ready_compute.begin(); it != worker.ready_compute.end(); ++it) {
          if (avail_[*it] > now) continue;
          if (best == worker.ready_compute.end() || Before(*it, *best)) best = it;
        }
        if (best != worker.ready_compute.end()) {
          const size_t task = *best;
          worker.ready_compute.erase(best);
          ChargeGap(worker, worker.compute_free, now, cause_[task]);
          const double duration = times_[task].ms + overhead_ + worker.debt;
          worker.debt = 0;
          if (sharing_.capacity > 0) {  // ends when its work is done at the shared rate
            start_[task] = now;
            worker.running = task;
            worker.remaining = duration;
            worker.compute_free = std::numeric_limits<double>::infinity();
            running_.push_back(static_cast<size_t>(&worker - workers_.data()));
          } else {
            worker.figures.compute_ms += duration;
            Start(task, now, duration);
            worker.compute_free = end_[task];
            worker.last_compute_end = end_[task];
            Touch(worker, end_[task], Lane::kCompute);
          }
        }
      }
      if (worker.io_free <= now) {
        auto best = worker.ready_io.end();
        for (auto it = worker.ready_io.begin(); it != worker.ready_io.end(); ++it) {
          if (avail_[*it] > now) continue;
          if (best == worker.ready_io.end() || avail_[*it] < avail_[*best] ||
              (avail_[*it] == avail_[*best] && *it < *best)) {
            best = it;
          }
        }
        if (best != worker.ready_io.end()) {
          const size_t task = *best;
          worker.ready_io.erase(best);
          const double bytes = static_cast<double>(OutputBytes(graph_, graph_.tasks()[task]));
          const double copy =
              links_.disk_bytes_per_us > 0 ? bytes / links_.disk_bytes_per_us / 1e3 : 0;
          worker.debt += times_[task].ms;
          Start(task, now, copy);
          worker.io_free = end_[task];
          Touch(worker, end_[task], Lane::kIo);
        }
      }
    }
    // Collectives whose members are all ready, in the order they became so (then by id), each
    // once every earlier collective of its channel has started on its members' workers (the
    // channel then runs it after them: channel_free).
    std::stable_sort(waiting_.begin(), waiting_.end(), [this](size_t a, size_t b) {
      return std::tie(members_ready_[a], a) < std::tie(members_ready_[b], b);
    });
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      Collective& collective = collectives_[*it];
      const auto channel = static_cast<size_t>(collective.channel);
      const bool free =
          members_ready_[*it] <= now && channels_.IsNext(collective.id) &&
          std::all_of(collective.members.begin(), collective.members.end(), [&](size_t m) {
            return workers_[worker_of_[m]].channel_free[channel] <= now;
          });
      if (!free) {
        ++it;
        continue;
      }
      channels_.Pop(collective.id);
      const double duration = CollectiveMs(collective);
      if (sharing_.capacity > 0) {  // its members take the machine's cores too
        for (size_t m : collective.members) {
          start_[m] = now;
          workers_[worker_of_[m]].channel_free[channel] = std::numeric_limits<double>::infinity();
        }
        running_collectives_.push_back(RunningCollective{*it, duration});
      } else {
        for (size_t m : collective.members) {
          Start(m, now, duration);
          Worker& worker = workers_[worker_of_[m]];
          worker.channel_free[channel] = now + duration;
          Touch(worker, now + duration, Lane::kCollective);
        }
      }
      it = waiting_.erase(it);
    }
  }

  // Each worker's group of shared cores and each group's capacity: ComputeSharing::groups, the
  // workers in none together in one more group of the whole capacity.
  void GroupWorkers() {
    const size_t rest = sharing_.groups.size();
    group_capacity_.assign(rest + 1, sharing_.capacity);
    for (size_t g = 0; g < rest; ++g) {
      group_capacity_[g] = sharing_.capacity * sharing_.groups[g].share;
    }
    for (Worker& worker : workers_) {
      worker.group = rest;
      for (size_t g = 0; g < rest; ++g) {
        const std::vector<WorkerId>& members = sharing_.groups[g].workers;
        if (std::find(members.begin(), members.end(), worker.figures.worker) != members.end()) {
          worker.group = g;
          break;
        }
      }
    }
    group_rate_.assign(group_capacity_.size(), 1);
    group_running_.assign(group_capacity_.size(), 0);
  }

  // The rate each group's running compute tasks and collectives progress at (group_rate_): all
  // at full speed up to the group's capacity (its users: compute tasks and tensor-parallel
  // collectives' members), then the capacity shared evenly;
  // one alone on its group's cores at full speed whatever the capacity (a group of one core's
  // share of it is below one: what two lose taking turns on that core, not what one loses).
  void SharedRates() {
    if (sharing_.capacity <= 0) return;  // every rate stays 1
    std::vector<double>& running = group_running_;
    std::fill(running.begin(), running.end(), 0);
    for (size_t w : running_) running[workers_[w].group] += 1;
    // Only tensor parallelism's collectives take cores from the compute: a member waits for its
    // peers polling and yielding its core (core/transport/ucx_peer_transport.h), so a collective
    // beside the compute (a data-parallel all-reduce, ZeRO's gathers and reduce-scatters) leaves
    // the compute its cores; a tensor group's sits on its ranks' path between two of their
    // compute tasks, and its calibrated wait (StepLinks::GroupWaitUs) was fitted counting its
    // members as users.
    for (const RunningCollective& c : running_collectives_) {
      const Collective& collective = collectives_[c.collective];
      if (collective.channel != kTensorChannel) continue;
      for (size_t m : collective.members) running[workers_[worker_of_[m]].group] += 1;
    }
    for (size_t g = 0; g < running.size(); ++g) {
      group_rate_[g] = running[g] <= 1 ? 1 : std::min(1.0, group_capacity_[g] / running[g]);
    }
  }

  // A running collective progresses at its slowest member's group's rate.
  double CollectiveRate(size_t collective) const {
    double rate = 1;
    for (size_t m : collectives_[collective].members) {
      rate = std::min(rate, group_rate_[workers_[worker_of_[m]].group]);
    }
    return rate;
  }

  // Ready compute tasks: higher priority first, then the one ready first, then graph order.
  bool Before(size_t a, size_t b) const {
    const int32_t pa = graph_.tasks()[a].priority, pb = graph_.tasks()[b].priority;
    if (pa != pb) return pa > pb;
    if (avail_[a] != avail_[b]) return avail_[a] < avail_[b];
    return a < b;
  }

  static void Touch(Worker& worker, double end, Lane lane) {
    if (end >= worker.end) {
      worker.end = end;
      worker.last_lane = lane;
    }
  }

  Result<SimulatedStep> Finish() {
    SimulatedStep step;
    step.start_ms = start_;
    step.end_ms = end_;
    for (size_t w = 0; w < workers_.size(); ++w) {
      Worker& worker = workers_[w];
      SimulatedWorker f = worker.figures;
      f.end_ms = worker.end;
      const double tail = worker.end - worker.last_compute_end;
      if (tail > 0) (worker.last_lane == Lane::kIo ? f.swap_ms : f.communication_ms) += tail;
      if (f.end_ms >= step.step_ms) {
        step.step_ms = f.end_ms;
        step.critical = w;
      }
      step.workers.push_back(f);
    }
    if (!step.workers.empty()) {
      const SimulatedWorker& c = step.workers[step.critical];
      const std::array<std::pair<double, Bottleneck>, 4> parts{
          {{c.compute_ms, Bottleneck::kCompute},
           {c.bubble_ms, Bottleneck::kBubble},
           {c.communication_ms, Bottleneck::kCommunication},
           {c.swap_ms, Bottleneck::kSwap}}};
      step.bottleneck = std::max_element(parts.begin(), parts.end(), [](auto a, auto b) {
                          return a.first < b.first;
                        })->second;
    }
    return step;
  }

  const Graph& graph_;
  const std::vector<TaskTime>& times_;
  const StepLinks& links_;
  const double overhead_;
  const ComputeSharing& sharing_;
  std::vector<Worker> workers_;
  std::vector<size_t> running_;  // sharing: the workers whose compute lane runs a task
  // Sharing: the collectives running, each member a user of the machine's cores.
  struct RunningCollective {
    size_t collective = 0;
    double remaining = 0;  // ms at the full rate
    double rate = 1;       // its members' slowest group's, as of the last SharedRates
  };
  std::vector<RunningCollective> running_collectives_;
  // Per group of shared cores (GroupWorkers): its capacity, its rate and (SharedRates' scratch)
  // how many run on it.
  std::vector<double> group_capacity_, group_rate_, group_running_;
  std::vector<size_t> worker_of_;
  std::vector<Lane> lane_;
  std::vector<int64_t> collective_of_;
  std::vector<Collective> collectives_;
  ChannelQueues channels_;
  std::vector<int> pending_;
  std::vector<std::vector<std::pair<size_t, ObjectId>>> dependents_;
  std::vector<double> avail_, start_, end_, members_ready_;
  std::vector<size_t> arrived_;
  std::vector<ReadyCause> cause_;
  std::vector<size_t> waiting_;  // collectives whose members are all ready, not started
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events_;
};

}  // namespace

namespace {

// The latency of the largest count in `by_members` (ascending) at or below `members`, else
// `otherwise`.
double LatencyAtOrBelow(const std::vector<StepLinks::GroupLatency>& by_members, int members,
                        double otherwise) {
  double latency = otherwise;
  for (const StepLinks::GroupLatency& group : by_members) {
    if (group.members > members) break;
    latency = group.latency_us;
  }
  return latency;
}

}  // namespace

double StepLinks::LatencyUs(int members) const {
  return LatencyAtOrBelow(group_latency, members, collective.latency_us);
}

double StepLinks::SequenceShardLatencyUs(int members) const {
  return LatencyAtOrBelow(sequence_shard_latency, members, LatencyUs(members));
}

double StepLinks::GatherLatencyUs(int members) const {
  return LatencyAtOrBelow(gather_latency, members, LatencyUs(members));
}

double StepLinks::ExchangeLatencyUs(int members) const {
  return LatencyAtOrBelow(exchange_latency, members, LatencyUs(members));
}

double StepLinks::GroupWaitUs(GroupWait wait, int members, bool staged) const {
  double latency = LatencyUs(members);
  if (wait == GroupWait::kSequenceShard) latency = SequenceShardLatencyUs(members);
  if (wait == GroupWait::kExchange) latency = ExchangeLatencyUs(members);
  if (!staged) return latency;
  // A group inside a pipeline waits at least what it waits side by side: a smaller group's staged
  // figure (the only one at or below a count the calibration did not probe) can be below it.
  double staged_wait = latency;
  for (const StagedLatency& entry : staged_latency) {
    if (entry.wait != wait || entry.members > members) continue;
    staged_wait = entry.latency_us;
  }
  return std::max(staged_wait, latency);
}

const char* BottleneckName(Bottleneck bottleneck) {
  switch (bottleneck) {
    case Bottleneck::kCompute:
      return "compute";
    case Bottleneck::kBubble:
      return "bubble";
    case Bottleneck::kCommunication:
      return "communication";
    case Bottleneck::kSwap:
      return "swap";
  }
  return "?";
}

std::vector<WorkerOrder> TimedWorkerOrders(const Graph& graph, const SimulatedStep& simulated) {
  std::vector<WorkerOrder> orders;
  std::unordered_map<WorkerId, size_t> index;
  const size_t n = graph.tasks().size();
  for (size_t t = 0; t < n; ++t) {
    const TaskSpec& task = graph.tasks()[t];
    auto [it, added] = index.emplace(task.pinned_worker, orders.size());
    if (added) orders.push_back(WorkerOrder{task.pinned_worker, {}});
    orders[it->second].tasks.push_back(task.id);
  }
  for (WorkerOrder& order : orders) {
    std::stable_sort(order.tasks.begin(), order.tasks.end(), [&simulated](TaskId a, TaskId b) {
      const size_t x = a.value() - 1, y = b.value() - 1;
      return std::tie(simulated.end_ms[x], simulated.start_ms[x], x) <
             std::tie(simulated.end_ms[y], simulated.start_ms[y], y);
    });
  }
  return orders;
}

Result<MemoryProfile> PredictTimedMemory(const Graph& graph, const SimulatedStep& simulated) {
  return PredictMemory(graph, TimedWorkerOrders(graph, simulated), simulated.end_ms);
}

Result<SimulatedStep> SimulateStep(const Graph& graph, const std::vector<TaskTime>& times,
                                   const StepLinks& links, double task_overhead_ms,
                                   const ComputeSharing& sharing) {
  return Simulator(graph, times, links, task_overhead_ms, sharing).Run();
}

}  // namespace tessera
