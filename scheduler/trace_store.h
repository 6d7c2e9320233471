// TraceStore: the spans of the latest graph instances, kept for TimelineRequest.
//
// Each worker sends its spans of an instance with InstanceFinished (core/timeline.h
// WorkerSpans: graph-local task and object ids, times on the system clock), packed; the store
// keeps them packed (about 6 bytes a span) and names them only when collected. It keeps the
// spans of the latest `max_instances` instances of drivers' registered graphs (the steps),
// whatever their graph (older ones are dropped whole as newer ones arrive: memory is bounded by
// max_instances times the spans of an instance), and apart from them those of the latest
// kSubmittedInstances submitted tasks (one-task instances, so a burst of them never pushes the
// steps out), with the graph's task names, layers, ops and kinds (core/timeline.h
// ClassifyTask), resolved once per graph and shared by its instances.
//
// Thread safety: none; the scheduler's io thread drives it.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/graph.h"
#include "core/ids.h"
#include "core/status.h"
#include "core/timeline.h"

namespace tessera {

class TraceStore {
 public:
  // REQUIRES: max_instances >= 1.
  explicit TraceStore(int max_instances);

  static constexpr size_t kSubmittedInstances = 256;

  // `worker`'s spans of an instance of `graph` (whose tasks and objects, graph-local ids dense
  // from 1, label them; null when the graph is unknown: spans are then named by their ids);
  // `submitted`: a submitted task's (or dynamic collective's) instance, not a driver's graph's.
  void Record(WorkerId worker, uint64_t graph, uint64_t instance, const WorkerSpans& spans,
              const std::vector<TaskSpec>* tasks, const std::vector<ObjectSpec>* objects,
              bool submitted = false);
  // The same, packed as InstanceFinished carries them (core/timeline.h PackSpans), kept packed
  // until collected. InvalidArgument (nothing kept) for a damaged packing.
  Status RecordPacked(WorkerId worker, uint64_t graph, uint64_t instance, std::string_view packed,
                      const std::vector<TaskSpec>* tasks, const std::vector<ObjectSpec>* objects,
                      bool submitted = false);

  // The spans of the latest `last` drivers' graph instances kept (of `graph` only, when
  // non-zero), oldest instance first, leaving out those `running` says are not finished (a
  // worker's spans may still be on their way); last <= 0: every one kept. Asked for any graph
  // (0), the kept submitted tasks' spans come too.
  std::vector<TimelineSpan> Collect(int last, uint64_t graph,
                                    const std::function<bool(uint64_t, uint64_t)>& running) const;

  size_t instances() const { return instances_.size(); }
  int max_instances() const { return max_instances_; }

 private:
  struct Labels {
    struct Task {
      std::string name, layer, op;
      SpanKind kind = SpanKind::kOther;
    };
    std::vector<Task> tasks;           // by graph-local id - 1
    std::vector<std::string> objects;  // by graph-local id - 1
  };
  struct Instance {
    uint64_t graph = 0;
    uint64_t instance = 0;
    std::shared_ptr<const Labels> labels;
    std::vector<std::pair<WorkerId, std::string>> workers;  // packed spans (PackSpans)
  };

  void Keep(WorkerId worker, uint64_t graph, uint64_t instance, std::string packed,
            const std::vector<TaskSpec>* tasks, const std::vector<ObjectSpec>* objects,
            bool submitted);
  std::shared_ptr<const Labels> LabelsFor(uint64_t graph, const std::vector<TaskSpec>* tasks,
                                          const std::vector<ObjectSpec>* objects);

  // Kept instances, oldest first, with an index by (graph, instance): a report finds its
  // instance without a scan (every submitted task's report comes here). A deque's push_back and
  // pop_front leave the other elements where they are, so the index points into it.
  using Index = std::unordered_map<std::pair<uint64_t, uint64_t>, Instance*, IdPairHash>;

  const int max_instances_;
  std::deque<Instance> instances_;  // oldest first
  std::deque<Instance> submitted_;  // oldest first
  Index instances_index_, submitted_index_;
  std::map<uint64_t, std::weak_ptr<const Labels>> labels_;  // by graph, while instances use them
};

}  // namespace tessera
