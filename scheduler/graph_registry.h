// GraphRegistry: every graph the scheduler runs, and where its tasks run.
//
// Work reaches the workers in one form only: an instance of a placed graph (instance_table.h).
// Graphs come from two places:
//   - A driver registers one (RegisterGraph). It is checked (GraphFromWire), placed then and there
//     (PlaceGraph over the alive workers; GPU workers only for a graph with GPU tasks), and every
//     instance runs with that placement.
//   - The task table asks for the graph of a submitted task (a one-task graph) or of a dynamic
//     collective (a graph of its members, one per rank). These are templates, cached by what they
//     compute (ops, attributes, shapes, dtypes, devices, priorities, pins; not names or ids), and
//     placed for each instance (the holders of the bound inputs decide: placement.h). Each
//     distinct placement of a template is a placed graph of its own, cached too, so a worker gets
//     its part once however many instances of it run there.
// A placed graph holds, per task, its worker; per collective member, its group (the members'
// workers in rank order) and its position among the graph's members on that worker; per worker,
// how many members it runs there (the instance adds the worker's base: core/collective_task.h).
//
// Parts: a worker receives a placed graph's part (GraphPart: every task with its worker) the
// first time an instance involves it (SendPartsTo). Templates are bounded (kMaxTemplates): the
// least recently used one with no instance running is forgotten, here and on the workers that
// hold its parts (ForgetGraph).
//
// Retirement: a placed graph that involves a worker that died can never run again (its tasks are
// placed on that worker, and a worker's id is never reused), nor can a registered graph whose
// driver left. Such graphs are retired (WorkerDied, DriverGone): forgotten here and on the workers
// that hold their parts once no instance of them runs, so neither the scheduler nor a worker
// grows with every recovery that registers the step graph again on the workers there are. A
// driver that runs a retired graph of its own is told why (Unavailable: register it again); the
// reasons of the latest kMaxRetired retired graphs are kept for that.
//
// Plugins: a registered graph may name plugins (ops/plugin.h) its driver sent before; each
// worker gets a plugin's library before the first part naming it (plugin_store.h).
//
// Errors: a returned error from Register is a protocol violation by the driver (the core closes
// its connection); a graph that cannot be placed is answered with a Reply carrying the reason.
//
// Thread safety: none; the scheduler's io thread drives it.
#pragma once

#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/graph.h"
#include "core/ids.h"
#include "core/proto/tessera.capnp.h"
#include "core/rpc/wire_limits.h"
#include "core/status.h"
#include "scheduler/collective_groups.h"
#include "scheduler/outbox.h"
#include "scheduler/participants.h"
#include "scheduler/placement.h"
#include "scheduler/plugin_store.h"

namespace tessera {

// The graph a RegisterGraph carries, checked. InvalidArgument naming the graph or the task for:
// object or task ids that are not dense from 1, a task reading an unknown object, an object
// produced by two tasks (or by none that exists), a graph output that is not an object of the
// graph, and whatever Graph::Validate finds (duplicate names, a task without an op, bad
// donations, cycles: prefixed "graph <id>: "). Errors decoding the wire (rpc::FromWire against
// `limits`: sizes, tensor bytes, group sizes, ...) are returned as they are.
Result<Graph> GraphFromWire(uint64_t graph_id, proto::RegisterGraph::Reader wire,
                            const rpc::WireLimits& limits);

struct PlacedGraph {
  uint64_t id = 0;
  WorkerId driver;                  // the registering driver; invalid for a template's
  std::vector<ObjectSpec> objects;  // graph-local ids, dense from 1
  std::vector<TaskSpec> tasks;      // graph-local ids, dense from 1; with group and position
  std::vector<WorkerId> task_worker;
  std::vector<WorkerId> workers;  // involved, ascending
  std::vector<ObjectId> inputs;   // graph-local ids of objects no task produces
  std::vector<ObjectId> outputs;  // graph-local ids returned as cluster objects
  std::set<uint64_t> groups;      // the collective groups its collectives use
  // Collective members per worker and channel.
  std::map<std::pair<WorkerId, int>, int64_t> members;
  std::vector<PluginRef> plugins;  // the plugins its tasks need (a registered graph's)
  std::set<WorkerId> has_part;     // workers that received its part
  uint64_t template_id = 0;        // the template it places (0: a driver's graph)
  int running = 0;                 // its instances running
  std::string retired;             // why it can no longer run; empty while it can
};

class GraphRegistry {
 public:
  // At most this many templates are kept (with their placed graphs).
  static constexpr size_t kMaxTemplates = 4096;
  // The reasons of at most this many retired registered graphs are kept.
  static constexpr size_t kMaxRetired = 1024;

  // The parts must outlive the registry. `allow_plugins`: drivers' plugins are accepted
  // (SchedulerOptions::allow_plugins).
  GraphRegistry(Outbox* outbox, ParticipantTable* participants, CollectiveGroups* groups,
                bool allow_plugins = true);

  // `driver` registers a graph (request `request_id`, answered with a Reply: OK, or why not: an
  // id in use or reserved, no alive worker, a placement that cannot work, a graph without
  // tasks). Decoded against `limits` (GraphFromWire).
  Status Register(WorkerId driver, uint64_t request_id, proto::RegisterGraph::Reader wire,
                  const rpc::WireLimits& limits);

  // The template of one submitted task: its inputs (in order, with their metas; a task may read
  // an object twice) become the graph's inputs and its outputs the graph's outputs. Returns the
  // template's id. InvalidArgument for a task the graph checks refuse.
  Result<uint64_t> TaskTemplate(const TaskSpec& task, const std::vector<TensorMeta>& input_metas,
                                const std::vector<ObjectSpec>& outputs);
  // The template of a dynamic collective: its members by rank, each reading its own inputs.
  Result<uint64_t> CollectiveTemplate(const std::vector<const TaskSpec*>& members,
                                      const std::vector<std::vector<TensorMeta>>& input_metas,
                                      const std::vector<const std::vector<ObjectSpec>*>& outputs);
  // The template placed for an instance, given what placement knows now (placement.h's errors).
  Result<PlacedGraph*> Place(uint64_t template_id, const PlacementView& view);
  // A template's graph (its inputs are ids 1..k in the order TaskTemplate gave them).
  const Graph& TemplateGraph(uint64_t template_id) const {
    return templates_.at(template_id).graph;
  }

  // The plugins drivers sent (LoadPlugin), which registered graphs name.
  PluginStore& plugins() { return plugins_; }

  // Sends `graph`'s part to those of `workers` that lack it (and first each plugin the graph
  // names that such a worker was not sent).
  void SendPartsTo(PlacedGraph& graph, const std::vector<WorkerId>& workers);

  // A placed graph (registered or placed template); null when unknown.
  PlacedGraph* Find(uint64_t id);
  const PlacedGraph* Find(uint64_t id) const;
  // A registered graph's tasks and objects (graph-local ids, dense from 1); null when unknown.
  const std::vector<TaskSpec>* Tasks(uint64_t graph) const;
  const std::vector<ObjectSpec>* Objects(uint64_t graph) const;

  // Why `driver`'s registered graph `id` can no longer run ("it was placed on worker-3 (...),
  // which died"); null when it is not a retired graph of that driver (or was retired too long
  // ago). A retired graph that still has instances running is found by Find too (with its
  // `retired` reason set) until they end.
  const std::string* RetiredReason(WorkerId driver, uint64_t id) const;

  // Instances of a placed graph start and end (graphs and templates in use are never forgotten).
  // InstanceEnded may forget `graph` (retired, and this was its last instance): the reference is
  // not to be used after it.
  void InstanceStarted(PlacedGraph& graph);
  void InstanceEnded(PlacedGraph& graph);
  // `worker` is gone: it holds no parts any more, and the graphs placed on it are retired.
  void WorkerDied(WorkerId worker);
  // `driver` left: its registered graphs are retired.
  void DriverGone(WorkerId driver);
  size_t templates() const { return templates_.size(); }
  // Placed graphs held (registered ones and placed templates), retired ones still running
  // included.
  size_t graphs() const { return graphs_.size(); }

 private:
  struct Template {
    Graph graph;
    std::string key;
    std::map<std::vector<WorkerId>, uint64_t> placed;  // placement -> placed graph id
    int running = 0;                                   // instances of its placed graphs
    std::list<uint64_t>::iterator lru;
  };

  // Makes a template the most recently used one; returns its id.
  uint64_t Touch(uint64_t template_id);
  // Finds or adds the template of `graph` under `key` (most recently used).
  Result<uint64_t> TemplateFor(std::string key, Graph graph);
  // Keys the groups of a placed graph's collectives and gives each member its group and its
  // position among the graph's members on its worker. InvalidArgument for inconsistent members.
  Status AssignCollectives(PlacedGraph& graph);
  // Fills a placed graph's derived fields from its tasks and placement.
  Status Complete(PlacedGraph& graph);
  // Forgets least recently used templates beyond kMaxTemplates that no instance uses.
  void Evict();
  // Marks `graph` as unable to run, for `reason`: no new instance of it starts (a template's
  // placement no longer maps to it), and it is forgotten at once or when its last instance ends.
  void Retire(PlacedGraph& graph, std::string reason);
  // Drops graph `id` here and tells the workers that hold its part to drop theirs.
  void Forget(uint64_t id);

  Outbox* outbox_;
  ParticipantTable* participants_;
  CollectiveGroups* groups_;
  PluginStore plugins_;
  std::unordered_map<uint64_t, PlacedGraph> graphs_;  // registered and placed templates
  std::unordered_map<uint64_t, Template> templates_;
  std::unordered_map<std::string, uint64_t> template_of_key_;
  std::list<uint64_t> lru_;  // template ids, most recently used first
  struct RetiredGraph {
    uint64_t id = 0;
    WorkerId driver;
    std::string reason;
  };
  std::deque<RetiredGraph> retired_;  // registered graphs forgotten, latest last (kMaxRetired)
  uint64_t next_id_ = kFirstSchedulerGraphId;  // the scheduler's own graph ids
};

}  // namespace tessera
