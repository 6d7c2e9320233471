// Messages: every message the scheduler sends, built in one place.
//
// Each Send* function takes plain data (ids, specs, statuses, and views of the scheduler's
// records), builds the Envelope and hands it to the Outbox; none reads or changes scheduler
// state. The parts of the scheduler decide what to say and to whom; this file only says how it
// looks on the wire (core/proto/tessera.capnp). Views (spans, string_views, pointers) must stay
// valid for the call only.
//
// Thread safety: none needed; the functions keep no state.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/graph.h"
#include "core/ids.h"
#include "core/status.h"
#include "core/timeline.h"
#include "scheduler/object_directory.h"
#include "scheduler/outbox.h"
#include "scheduler/participants.h"

namespace tessera {

// Where an object can be pulled from: its first holder's data plane.
struct ObjectSource {
  ObjectId object;
  int64_t bytes = 0;
  WorkerId holder;  // invalid when nothing holds it (it travels inline)
  std::string_view address;
};
// The source of a directory entry: its first holder, at that holder's address.
// REQUIRES: every holder is a listed participant.
ObjectSource SourceOf(const ObjectEntry& object, const ParticipantTable& participants);
// The same with `holder` (one of its holders, a listed participant) as the source.
ObjectSource SourceOf(const ObjectEntry& object, const ParticipantTable& participants,
                      WorkerId holder);

// An object's bytes carried in the message (id: a cluster id, or graph-local for RunGraph).
struct InlineObject {
  uint64_t id = 0;
  std::string_view data;
};

// One object of an ObjectsReady: its error (it failed, or is unknown), else where it is.
struct ObjectReport {
  ObjectId id;
  Status error;
  ObjectSource source;
  std::string_view inline_data;
};

// The submitted tasks by state (TaskTable::counts); SchedulerCore::task_counts adds registered
// graphs' finished tasks to done.
struct TaskCounts {
  int64_t waiting = 0;  // for inputs, or for their collective's siblings
  int64_t running = 0;  // started (their instance runs)
  int64_t done = 0;     // finished since the start
};

// A StatusReply: the workers (dead ones too) and the cluster's counts.
struct StatusSummary {
  std::vector<const Participant*> workers;
  std::vector<WorkerWaitLine> waits;  // per worker, in the same order (scheduler/waits.h)
  int drivers = 0;
  size_t objects = 0;
  TaskCounts tasks;
  std::string_view session_dir;
};

// A placed graph (graph_registry.h), as every involved worker receives it.
// A plugin as a graph names it (ops/plugin.h).
struct PluginRef {
  std::string name;
  std::string sha256;
};

struct GraphPart {
  uint64_t graph_id = 0;
  std::span<const ObjectSpec> objects;  // graph-local ids, dense from 1
  std::span<const TaskSpec> tasks;      // every task (a worker needs the others' inputs too)
  std::span<const WorkerId> task_workers;
  std::vector<std::pair<WorkerId, std::string_view>> worker_addresses;
  std::span<const ObjectId> outputs;
  std::span<const PluginRef> plugins;  // the plugins the part's tasks need loaded
};

// Where an instance's collective members start in a worker's order of a channel's collectives.
struct CollectiveBase {
  WorkerId worker;
  int channel = 0;
  int64_t base = 0;
};

// One instance of a placed graph.
struct GraphRun {
  uint64_t graph_id = 0;
  uint64_t instance = 0;
  std::span<const ObjectId> output_ids;  // cluster ids for the graph's outputs, in order
  std::vector<std::pair<uint64_t, ObjectSource>> inputs;  // graph-local id, bound object
  std::vector<InlineObject> inline_inputs;                // graph-local id, bytes
  std::vector<uint64_t> take_over;  // graph-local ids whose holder moves them out of its store
  std::span<const std::string> task_names;  // per graph task; empty: the part's names
  std::span<const int64_t> collective_ids;  // per graph task; empty: the part's
  // Per worker and channel with members: where the instance's members start there.
  std::vector<CollectiveBase> collective_bases;
};

// Joining.
void SendRefused(Outbox& outbox, WorkerId to, uint64_t request_id, const Status& reason);
void SendWelcome(Outbox& outbox, WorkerId to, uint32_t heartbeat_interval_ms,
                 std::string_view session_dir);
// The answer to a request: OK, or the error.
void SendReply(Outbox& outbox, WorkerId to, uint64_t request_id, const Status& status);
void SendStatusReply(Outbox& outbox, WorkerId to, uint64_t request_id,
                     const StatusSummary& summary);
void SendShutdown(Outbox& outbox, WorkerId to);
// The answer to a TimelineRequest.
void SendTimelineReply(Outbox& outbox, WorkerId to, uint64_t request_id, const Timeline& timeline);
void SendKeepalive(Outbox& outbox, WorkerId to);

// Objects.
void SendObjectsReady(Outbox& outbox, WorkerId to, std::span<const ObjectReport> objects);
void SendFreeObjects(Outbox& outbox, WorkerId to, std::span<const ObjectId> ids);
// Objects a driver handed to a failed run (graph `graph_id`, instance `instance`) that came
// back unchanged: the driver holds them again.
void SendHandedBack(Outbox& outbox, WorkerId to, uint64_t graph_id, uint64_t instance,
                    std::span<const ObjectId> ids);

// Placed graphs and their instances: the same message to each of `to`.
void SendGraphPart(Outbox& outbox, std::span<const WorkerId> to, const GraphPart& part);
void SendRunGraph(Outbox& outbox, std::span<const WorkerId> to, const GraphRun& run);
void SendCancelInstance(Outbox& outbox, WorkerId to, uint64_t graph_id, uint64_t instance,
                        const Status& error);
void SendForgetGraphs(Outbox& outbox, WorkerId to, std::span<const uint64_t> graph_ids);
void SendLoadPlugin(Outbox& outbox, WorkerId to, const PluginRef& plugin, std::string_view library);

}  // namespace tessera
