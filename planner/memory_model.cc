#include "planner/memory_model.h"

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>

#include <fmt/format.h>

#include "core/collective_task.h"
#include "core/disk_tasks.h"
#include "planner/channel_order.h"

namespace tessera {

const char* MemoryTierName(MemoryTier tier) {
  switch (tier) {
    case MemoryTier::kDevice:
      return "device";
    case MemoryTier::kHost:
      return "host";
    case MemoryTier::kDisk:
      return "disk";
  }
  return "?";
}

MemoryTier TierOf(const TensorMeta& meta) { return TierOf(meta.device); }

MemoryTier TierOf(const Device& device) {
  switch (device.kind) {
    case DeviceKind::kCpu:
      return MemoryTier::kHost;
    case DeviceKind::kCuda:
      return MemoryTier::kDevice;
    case DeviceKind::kDisk:
      return MemoryTier::kDisk;
  }
  return MemoryTier::kHost;
}

namespace {

size_t Index(TaskId id) { return static_cast<size_t>(id.value() - 1); }
size_t Index(ObjectId id) { return static_cast<size_t>(id.value() - 1); }
size_t TierIndex(MemoryTier tier) { return static_cast<size_t>(tier); }

// Where a task's kernel scratch lives: its device's memory (the host for CPU tasks).
size_t ScratchTier(const TaskSpec& task) {
  return TierIndex(task.device_kind == DeviceKind::kCpu ? MemoryTier::kHost : MemoryTier::kDevice);
}
size_t RoleIndex(ObjectRole role) { return static_cast<size_t>(role); }

// The graph's workers (WorkerOrder's indexing) and each task's.
struct Workers {
  std::vector<WorkerId> ids;
  std::vector<int> of_task;
};

Workers IndexWorkers(const Graph& graph) {
  Workers workers;
  std::unordered_map<WorkerId, int> index;
  for (const TaskSpec& task : graph.tasks()) {
    auto [it, added] = index.emplace(task.pinned_worker, static_cast<int>(workers.ids.size()));
    if (added) workers.ids.push_back(task.pinned_worker);
    workers.of_task.push_back(it->second);
  }
  if (workers.ids.empty()) workers.ids.push_back(WorkerId());  // a graph without tasks
  return workers;
}

// What each task waits for, counted as the executor counts it (an input's producer once per
// input, each control edge), and whom it releases.
struct Dependencies {
  std::vector<int> pending;
  std::vector<std::vector<size_t>> dependents;
};

Dependencies CountDependencies(const Graph& graph) {
  Dependencies deps;
  const size_t n = graph.tasks().size();
  deps.pending.assign(n, 0);
  deps.dependents.resize(n);
  for (size_t t = 0; t < n; ++t) {
    const TaskSpec& task = graph.tasks()[t];
    for (ObjectId input : task.inputs) {
      const TaskId producer = graph.object(input).producer;
      if (!producer.valid()) continue;
      ++deps.pending[t];
      deps.dependents[Index(producer)].push_back(t);
    }
    for (TaskId earlier : task.after) {
      ++deps.pending[t];
      deps.dependents[Index(earlier)].push_back(t);
    }
  }
  return deps;
}

// A collective's members the engine runs (several members; a one-member collective is a kernel).
Result<std::vector<std::optional<CollectiveMembership>>> EngineMembers(const Graph& graph) {
  std::vector<std::optional<CollectiveMembership>> members;
  members.reserve(graph.tasks().size());
  for (const TaskSpec& task : graph.tasks()) {
    TESSERA_ASSIGN_OR_RETURN(std::optional<CollectiveMembership> member, CollectiveOf(task));
    if (member && member->group_size <= 1) member.reset();
    members.push_back(member);
  }
  return members;
}

// Runs the graph in unit-time rounds. Free: each worker takes its best ready task each round
// (priority, then first ready). Fixed: each worker runs its order's tasks in turn. Engine
// members take no slot: they start when ready and finish together, once every member is ready.
// Returns each task's finishing round and, when free, the orders.
struct Simulation {
  std::vector<WorkerOrder> orders;
  std::vector<int64_t> round_of_task;
};

Result<Simulation> Simulate(const Graph& graph, const Workers& workers,
                            const std::vector<WorkerOrder>* fixed) {
  const size_t n = graph.tasks().size();
  Dependencies deps = CountDependencies(graph);
  TESSERA_ASSIGN_OR_RETURN(auto members, EngineMembers(graph));
  TESSERA_ASSIGN_OR_RETURN(ChannelQueues channels, ChannelQueues::Of(graph));
  const size_t num_workers = workers.ids.size();
  Simulation sim;
  sim.round_of_task.assign(n, -1);
  sim.orders.resize(num_workers);
  for (size_t w = 0; w < num_workers; ++w) sim.orders[w].worker = workers.ids[w];

  using Queue = std::map<int32_t, std::deque<size_t>, std::greater<>>;
  std::vector<Queue> queues(num_workers);
  std::vector<bool> ready(n, false);
  std::vector<size_t> next_in_order(num_workers, 0);  // fixed: the next ordinary task's place
  std::map<int64_t, std::vector<size_t>> started;     // collective -> members ready so far
  std::set<int64_t> complete;  // collectives all of whose members are in, waiting for their turn
  auto make_ready = [&](size_t t) {
    ready[t] = true;
    if (members[t]) {
      std::vector<size_t>& in = started[members[t]->collective];
      in.push_back(t);
      if (static_cast<int>(in.size()) == members[t]->group_size) {
        complete.insert(members[t]->collective);
      }
      return;
    }
    if (fixed == nullptr) {
      queues[static_cast<size_t>(workers.of_task[t])][graph.tasks()[t].priority].push_back(t);
    }
  };
  for (size_t t = 0; t < n; ++t) {
    if (deps.pending[t] == 0) make_ready(t);
  }

  size_t finished = 0;
  for (int64_t round = 0; finished < n; ++round) {
    std::vector<size_t> finishing;
    for (size_t w = 0; w < num_workers; ++w) {
      if (fixed == nullptr) {
        Queue& queue = queues[w];
        if (queue.empty()) continue;
        auto best = queue.begin();
        finishing.push_back(best->second.front());
        best->second.pop_front();
        if (best->second.empty()) queue.erase(best);
        continue;
      }
      const std::vector<TaskId>& order = (*fixed)[w].tasks;
      size_t& next = next_in_order[w];
      while (next < order.size() && members[Index(order[next])]) ++next;
      if (next < order.size() && ready[Index(order[next])])
        finishing.push_back(Index(order[next++]));
    }
    // Collectives completing this round come first: a member runs off the worker's slot and,
    // as soon as its peers are there and every earlier collective of its channel has run on
    // their workers, finishes while that worker's task of the round still runs (what it made is
    // live during that task). One that runs lets the next of its channels run too.
    std::vector<int64_t> completing;
    std::vector<int64_t> turn;
    for (int64_t collective : complete) {
      if (channels.IsNext(collective)) turn.push_back(collective);
    }
    while (!turn.empty()) {
      const int64_t collective = turn.back();
      turn.pop_back();
      if (complete.erase(collective) == 0) continue;
      completing.push_back(collective);
      for (int64_t next : channels.Pop(collective)) {
        if (complete.count(next) > 0 && channels.IsNext(next)) turn.push_back(next);
      }
    }
    std::sort(completing.begin(), completing.end());
    std::vector<size_t> members_done;
    for (int64_t collective : completing) {
      std::vector<size_t>& in = started[collective];
      std::sort(in.begin(), in.end());
      members_done.insert(members_done.end(), in.begin(), in.end());
      started.erase(collective);
    }
    finishing.insert(finishing.begin(), members_done.begin(), members_done.end());
    if (finishing.empty()) {
      size_t t = 0;
      while (sim.round_of_task[t] >= 0) ++t;
      const TaskSpec& stuck = graph.tasks()[t];
      return InvalidArgument(
          "the tasks cannot all run: {} never {}", stuck.name,
          members[t] && ready[t]
              ? "meets the other members of its collective (one never becomes ready)"
              : "gets what it waits for (a cycle, or a worker's order puts a task before one it "
                "waits for on another worker)");
    }
    for (size_t t : finishing) {
      sim.round_of_task[t] = round;
      if (fixed == nullptr) {
        sim.orders[static_cast<size_t>(workers.of_task[t])].tasks.push_back(graph.tasks()[t].id);
      }
      ++finished;
    }
    for (size_t t : finishing) {
      for (size_t dependent : deps.dependents[t]) {
        if (--deps.pending[dependent] == 0) make_ready(dependent);
      }
    }
  }
  return sim;
}

// Where each task is in the orders; InvalidArgument unless every task is there exactly once,
// on its own worker, after what it waits for there.
Status CheckOrders(const Graph& graph, const Workers& workers,
                   const std::vector<WorkerOrder>& orders, std::vector<int>& position) {
  const size_t n = graph.tasks().size();
  if (orders.size() != workers.ids.size()) {
    return InvalidArgument("{} worker orders for a graph over {} workers", orders.size(),
                           workers.ids.size());
  }
  position.assign(n, -1);
  for (size_t w = 0; w < orders.size(); ++w) {
    for (size_t p = 0; p < orders[w].tasks.size(); ++p) {
      const TaskId id = orders[w].tasks[p];
      if (!id.valid() || Index(id) >= n) {
        return InvalidArgument("worker order {} names {}, not a task of the graph", w,
                               id.ToString());
      }
      const TaskSpec& task = graph.task(id);
      if (position[Index(id)] >= 0) return InvalidArgument("{} is ordered twice", task.name);
      if (workers.of_task[Index(id)] != static_cast<int>(w)) {
        return InvalidArgument("{} is in the order of worker index {}, not its worker's", task.name,
                               w);
      }
      position[Index(id)] = static_cast<int>(p);
    }
  }
  for (size_t t = 0; t < n; ++t) {
    const TaskSpec& task = graph.tasks()[t];
    if (position[t] < 0) return InvalidArgument("{} is in no worker's order", task.name);
    auto check = [&](TaskId earlier) -> Status {
      const size_t e = Index(earlier);
      if (workers.of_task[e] == workers.of_task[t] && position[e] >= position[t]) {
        return InvalidArgument("{} is ordered before {}, which it waits for", task.name,
                               graph.task(earlier).name);
      }
      return Status::Ok();
    };
    for (ObjectId input : task.inputs) {
      const TaskId producer = graph.object(input).producer;
      if (producer.valid()) TESSERA_RETURN_IF_ERROR(check(producer));
    }
    for (TaskId earlier : task.after) TESSERA_RETURN_IF_ERROR(check(earlier));
  }
  return Status::Ok();
}

// The lifetimes of the objects worker w holds (see the header's rules).
std::vector<ObjectLifetime> Lifetimes(const Graph& graph, const Workers& workers,
                                      const std::vector<WorkerOrder>& orders,
                                      const std::vector<int>& position,
                                      const std::vector<double>& finish_of_task,
                                      const std::vector<int>& latest_ancestor,
                                      const std::vector<bool>& read_anywhere, size_t w) {
  const std::vector<TaskId>& order = orders[w].tasks;
  const int size = static_cast<int>(order.size());
  const size_t num_objects = graph.objects().size();
  std::vector<int> last_reader(num_objects, -1);
  for (int p = 0; p < size; ++p) {
    for (ObjectId input : graph.task(order[static_cast<size_t>(p)]).inputs) {
      last_reader[Index(input)] = p;  // positions grow
    }
  }
  std::vector<ObjectLifetime> lifetimes;
  for (const ObjectSpec& object : graph.objects()) {
    const size_t o = Index(object.id);
    const bool output = graph.IsOutput(object.id);
    ObjectLifetime life;
    life.object = object.id;
    life.bytes = object.meta.bytes();
    life.role = object.role;
    life.tier = TierOf(object.meta);
    if (!object.producer.valid()) {
      // Bound when the step starts where it is read; one nobody reads, on the first worker.
      if (last_reader[o] < 0 && (read_anywhere[o] || w != 0)) continue;
      life.first = -1;
    } else {
      const size_t producer = Index(object.producer);
      if (workers.of_task[producer] == static_cast<int>(w)) {
        life.first = position[producer];
      } else {
        if (last_reader[o] < 0) continue;
        life.received = true;
        life.first = last_reader[o];
        if (!latest_ancestor.empty()) {
          // As early as its producer can finish: right after the last task here that the
          // producer waits for (directly or not), however fast the other workers run.
          const int after = latest_ancestor[producer * workers.ids.size() + w];
          life.first = std::min(life.first, after < 0 ? -1 : after + 1);
        } else {
          // Pushed when its producer finishes: live here from the first task that finishes
          // after it (the one running when it arrives, else the next).
          for (int p = 0; p < size; ++p) {
            if (finish_of_task[Index(order[static_cast<size_t>(p)])] > finish_of_task[producer]) {
              life.first = std::min(life.first, p);
              break;
            }
          }
        }
      }
    }
    if (output || (!object.producer.valid() && last_reader[o] < 0)) {
      life.last = size;  // kept after the step (an input nobody reads is never released)
    } else if (last_reader[o] >= 0) {
      life.last = last_reader[o];
      const TaskSpec& reader = graph.task(order[static_cast<size_t>(life.last)]);
      for (const Donation& donation : reader.donations) {
        if (reader.inputs[static_cast<size_t>(donation.input_index)] == object.id) {
          life.replaced = true;
        }
      }
      // Read last by a copy to the disk (a swap out), which the executor's I/O thread runs
      // beside the compute: live until the compute task after it has run too.
      if (TouchesDisk(graph, reader)) {
        for (int p = life.last + 1; p < size; ++p) {
          if (!TouchesDisk(graph, graph.task(order[static_cast<size_t>(p)]))) {
            life.last = p;
            break;
          }
        }
      }
    } else {
      life.last = life.first;  // nobody reads it here: freed as soon as it is made
    }
    lifetimes.push_back(life);
  }
  return lifetimes;
}

WorkerMemory Account(const Graph& graph, WorkerOrder order, std::vector<ObjectLifetime> lives) {
  WorkerMemory memory;
  const int size = static_cast<int>(order.tasks.size());
  memory.order = std::move(order);
  memory.objects = std::move(lives);
  // Per position: bytes that start being live there and that stop after it, by tier and role.
  // An object replaced at its last reader is not live during that reader's run.
  const size_t slots = static_cast<size_t>(size) + 2;  // positions -1 .. size
  std::vector<std::array<RoleArray, kMemoryTiers>> starts(slots), ends(slots);
  auto slot = [](int p) { return static_cast<size_t>(p) + 1; };  // p = -1 wraps to 0
  for (const ObjectLifetime& life : memory.objects) {
    const size_t tier = TierIndex(life.tier), role = RoleIndex(life.role);
    starts[slot(life.first)][tier][role] += life.bytes;
    const int end = life.last_live();
    if (end < life.first) {  // replaced at the very task that made or received it
      starts[slot(life.first)][tier][role] -= life.bytes;
      continue;
    }
    if (end < size) ends[slot(end)][tier][role] += life.bytes;
  }
  std::array<RoleArray, kMemoryTiers> live{};
  auto add = [](std::array<RoleArray, kMemoryTiers>& into,
                const std::array<RoleArray, kMemoryTiers>& delta, int64_t sign) {
    for (size_t tier = 0; tier < kMemoryTiers; ++tier) {
      for (size_t role = 0; role < kObjectRoles; ++role)
        into[tier][role] += sign * delta[tier][role];
    }
  };
  add(live, starts[slot(-1)], 1);
  for (size_t tier = 0; tier < kMemoryTiers; ++tier) {
    memory.peaks[tier].tier = static_cast<MemoryTier>(tier);
  }
  // `scratch`: the running task's kernel scratch per tier.
  auto observe = [&](int p, const std::array<int64_t, kMemoryTiers>& scratch) {
    RoleArray by_role{};
    std::array<int64_t, kMemoryTiers> tiers{};
    for (size_t tier = 0; tier < kMemoryTiers; ++tier) {
      for (size_t role = 0; role < kObjectRoles; ++role) {
        // The role figures are what memory holds (RoleMeter's): the disk tier is not memory.
        if (tier != TierIndex(MemoryTier::kDisk)) by_role[role] += live[tier][role];
        tiers[tier] += live[tier][role];
      }
      tiers[tier] += scratch[tier];
      if (tiers[tier] > memory.peaks[tier].bytes) {
        memory.peaks[tier].bytes = tiers[tier];
        memory.peaks[tier].position = p;
        memory.peaks[tier].by_role = live[tier];
        memory.peaks[tier].scratch = scratch[tier];
      }
    }
    int64_t total = 0;
    for (size_t role = 0; role < kObjectRoles; ++role) {
      memory.role_peaks[role] = std::max(memory.role_peaks[role], by_role[role]);
      total += by_role[role];
    }
    auto sum = [&](std::initializer_list<ObjectRole> roles) {
      int64_t bytes = 0;
      for (ObjectRole role : roles) bytes += by_role[RoleIndex(role)];
      return bytes;
    };
    memory.model_state_peak =
        std::max(memory.model_state_peak,
                 sum({ObjectRole::kParameter, ObjectRole::kGradient, ObjectRole::kOptimizerState}));
    memory.transient_peak = std::max(
        memory.transient_peak, sum({ObjectRole::kGatheredParameter, ObjectRole::kGradientBucket}));
    memory.total_peak = std::max(memory.total_peak, total);
    memory.total_with_scratch_peak =
        std::max(memory.total_with_scratch_peak, total + scratch[TierIndex(MemoryTier::kDevice)] +
                                                     scratch[TierIndex(MemoryTier::kHost)]);
    return tiers;
  };
  observe(-1, {});
  add(live, ends[slot(-1)], -1);  // inputs replaced by the first task's outputs
  for (int p = 0; p < size; ++p) {
    add(live, starts[slot(p)], 1);
    // The running task's kernel scratch, on its device's tier.
    const TaskSpec& running = graph.task(memory.order.tasks[static_cast<size_t>(p)]);
    std::array<int64_t, kMemoryTiers> scratch{};
    scratch[ScratchTier(running)] = running.workspace_bytes;
    memory.scratch.push_back(scratch);
    memory.during.push_back(observe(p, scratch));
    add(live, ends[slot(p)], -1);
  }
  for (TierPeak& peak : memory.peaks) {
    if (peak.bytes == 0) continue;
    for (const ObjectLifetime& life : memory.objects) {
      if (life.tier == peak.tier && life.LiveAt(peak.position)) peak.live.push_back(life.object);
    }
    std::stable_sort(peak.live.begin(), peak.live.end(), [&](ObjectId a, ObjectId b) {
      return graph.object(a).meta.bytes() > graph.object(b).meta.bytes();
    });
  }
  return memory;
}

// What a worker's tasks copy from one tier to another: the outputs of every task reading an
// object of one tier and making one of another (only transfer ops can).
int64_t TierCopyBytes(const Graph& graph, const WorkerOrder& order) {
  int64_t bytes = 0;
  for (TaskId id : order.tasks) {
    const TaskSpec& task = graph.task(id);
    if (task.inputs.empty() || task.outputs.empty()) continue;
    const MemoryTier from = TierOf(graph.object(task.inputs[0]).meta);
    for (ObjectId output : task.outputs) {
      const TensorMeta& meta = graph.object(output).meta;
      if (TierOf(meta) != from) bytes += meta.bytes();
    }
  }
  return bytes;
}

// For each task and worker (task * workers + worker): the latest position in that worker's
// order of a task it waits for, directly or not (itself included); -1 when none. Empty when no
// object crosses workers (nothing needs it).
std::vector<int> LatestAncestorPositions(const Graph& graph, const Workers& workers,
                                         const std::vector<int>& position) {
  const size_t n = graph.tasks().size(), num_workers = workers.ids.size();
  bool crosses = false;
  for (size_t t = 0; t < n && !crosses; ++t) {
    for (ObjectId input : graph.tasks()[t].inputs) {
      const TaskId producer = graph.object(input).producer;
      if (producer.valid() && workers.of_task[Index(producer)] != workers.of_task[t]) {
        crosses = true;
      }
    }
  }
  if (!crosses) return {};
  std::vector<int> latest(n * num_workers, -1);
  Dependencies deps = CountDependencies(graph);
  std::vector<size_t> ready;
  for (size_t t = 0; t < n; ++t) {
    if (deps.pending[t] == 0) ready.push_back(t);
  }
  while (!ready.empty()) {  // Kahn's order: a task's waits are final before it passes them on
    const size_t t = ready.back();
    ready.pop_back();
    int* mine = &latest[t * num_workers];
    const auto own = static_cast<size_t>(workers.of_task[t]);
    mine[own] = std::max(mine[own], position[t]);
    for (size_t dependent : deps.dependents[t]) {
      int* theirs = &latest[dependent * num_workers];
      for (size_t w = 0; w < num_workers; ++w) theirs[w] = std::max(theirs[w], mine[w]);
      if (--deps.pending[dependent] == 0) ready.push_back(dependent);
    }
  }
  return latest;
}

// `finish_of_task`: when each task finishes (a simulated step's times), for when what another
// worker sends arrives; empty: as early as it can (LatestAncestorPositions).
Result<MemoryProfile> Predict(const Graph& graph, const Workers& workers,
                              const std::vector<WorkerOrder>& orders,
                              const std::vector<double>& finish_of_task) {
  std::vector<int> position;
  TESSERA_RETURN_IF_ERROR(CheckOrders(graph, workers, orders, position));
  const std::vector<int> latest_ancestor = finish_of_task.empty()
                                               ? LatestAncestorPositions(graph, workers, position)
                                               : std::vector<int>();
  std::vector<bool> read_anywhere(graph.objects().size(), false);
  for (const TaskSpec& task : graph.tasks()) {
    for (ObjectId input : task.inputs) read_anywhere[Index(input)] = true;
  }
  MemoryProfile profile;
  for (size_t w = 0; w < orders.size(); ++w) {
    profile.workers.push_back(Account(graph, orders[w],
                                      Lifetimes(graph, workers, orders, position, finish_of_task,
                                                latest_ancestor, read_anywhere, w)));
    profile.workers.back().tier_copy_bytes = TierCopyBytes(graph, orders[w]);
  }
  return profile;
}

std::string Bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (int64_t{1} << 30)) return fmt::format("{:.2f} GiB", b / (1 << 30));
  if (bytes >= (int64_t{1} << 20)) return fmt::format("{:.2f} MiB", b / (1 << 20));
  if (bytes >= (int64_t{1} << 10)) return fmt::format("{:.1f} KiB", b / (1 << 10));
  return fmt::format("{} B", bytes);
}

std::string TaskAt(const Graph& graph, const WorkerMemory& memory, int p) {
  if (p < 0) return "before the first task";
  return fmt::format("{} (task {} of {})",
                     graph.task(memory.order.tasks[static_cast<size_t>(p)]).name, p + 1,
                     memory.order.tasks.size());
}

}  // namespace

Result<std::vector<WorkerOrder>> SimulateWorkerOrders(const Graph& graph) {
  const Workers workers = IndexWorkers(graph);
  TESSERA_ASSIGN_OR_RETURN(Simulation sim, Simulate(graph, workers, nullptr));
  return sim.orders;
}

Result<MemoryProfile> PredictMemory(const Graph& graph, const std::vector<WorkerOrder>& orders) {
  const Workers workers = IndexWorkers(graph);
  std::vector<int> position;
  TESSERA_RETURN_IF_ERROR(CheckOrders(graph, workers, orders, position));
  // The orders must be able to finish (a collective whose members wait on each other's turns
  // cannot).
  TESSERA_RETURN_IF_ERROR(Simulate(graph, workers, &orders).status());
  return Predict(graph, workers, orders, {});
}

Result<MemoryProfile> PredictMemory(const Graph& graph, const std::vector<WorkerOrder>& orders,
                                    const std::vector<double>& finish_ms) {
  const Workers workers = IndexWorkers(graph);
  if (finish_ms.size() != graph.tasks().size()) {
    return InvalidArgument("{} finishing times for a graph of {} tasks", finish_ms.size(),
                           graph.tasks().size());
  }
  std::vector<int> position;
  TESSERA_RETURN_IF_ERROR(CheckOrders(graph, workers, orders, position));
  return Predict(graph, workers, orders, finish_ms);
}

Result<MemoryProfile> PredictMemory(const Graph& graph) {
  const Workers workers = IndexWorkers(graph);
  TESSERA_ASSIGN_OR_RETURN(Simulation sim, Simulate(graph, workers, nullptr));
  return Predict(graph, workers, sim.orders, {});
}

std::string ExplainMemory(const Graph& graph, const MemoryProfile& profile, int timeline_points) {
  std::string text = fmt::format(
      "memory plan: predicted before the step runs, from each object's size and live interval "
      "in its worker's task order, with the running kernel's scratch space\n");
  for (size_t w = 0; w < profile.workers.size(); ++w) {
    const WorkerMemory& memory = profile.workers[w];
    text += fmt::format(
        "worker {} ({}): {} tasks, {} objects\n", w,
        memory.order.worker.valid() ? memory.order.worker.ToString() : std::string("unpinned"),
        memory.order.tasks.size(), memory.objects.size());
    if (memory.tier_copy_bytes > 0) {
      text += fmt::format("  copied between tiers: {} a step\n", Bytes(memory.tier_copy_bytes));
    }
    std::vector<size_t> tiers;
    for (size_t tier = 0; tier < kMemoryTiers; ++tier) {
      const TierPeak& peak = memory.peaks[tier];
      if (peak.bytes == 0) continue;
      tiers.push_back(tier);
      text += fmt::format("  {} tier: peak {} while {} runs\n", MemoryTierName(peak.tier),
                          Bytes(peak.bytes), TaskAt(graph, memory, peak.position));
      std::string roles;
      for (size_t role = 0; role < kObjectRoles; ++role) {
        if (peak.by_role[role] == 0) continue;
        roles +=
            fmt::format("{}{} {}", roles.empty() ? "" : ", ",
                        ObjectRoleName(static_cast<ObjectRole>(role)), Bytes(peak.by_role[role]));
      }
      if (peak.scratch > 0) {
        roles += fmt::format("{}kernel scratch {}", roles.empty() ? "" : ", ", Bytes(peak.scratch));
      }
      text += fmt::format("    live at the peak by role: {}\n", roles);
      const size_t shown = std::min<size_t>(peak.live.size(), 6);
      text += fmt::format("    largest of the {} live objects:", peak.live.size());
      for (size_t i = 0; i < shown; ++i) {
        const ObjectSpec& object = graph.object(peak.live[i]);
        text += fmt::format("{} {} {}", i == 0 ? "" : ",", object.name, Bytes(object.meta.bytes()));
      }
      text += "\n";
    }
    if (memory.during.empty() || tiers.empty()) continue;
    // The timeline: evenly spaced positions and the peaks'.
    std::vector<int> points;
    const int size = static_cast<int>(memory.during.size());
    const int wanted = std::max(2, timeline_points);
    points.reserve(static_cast<size_t>(wanted) + tiers.size());
    for (int i = 0; i < wanted; ++i) points.push_back(i * (size - 1) / (wanted - 1));
    for (size_t tier : tiers) {
      if (memory.peaks[tier].position >= 0) points.push_back(memory.peaks[tier].position);
    }
    std::sort(points.begin(), points.end());
    points.erase(std::unique(points.begin(), points.end()), points.end());
    text += "  timeline (live while the task runs):\n";
    for (int p : points) {
      std::string figures;
      for (size_t tier : tiers) {
        figures += fmt::format("  {} {:>10}", MemoryTierName(static_cast<MemoryTier>(tier)),
                               Bytes(memory.during[static_cast<size_t>(p)][tier]));
      }
      bool at_peak = false;
      for (size_t tier : tiers) at_peak = at_peak || memory.peaks[tier].position == p;
      text += fmt::format("    {:>6}{}  {}{}\n", p + 1, figures,
                          graph.task(memory.order.tasks[static_cast<size_t>(p)]).name,
                          at_peak ? "  <- peak" : "");
    }
  }
  return text;
}

}  // namespace tessera
