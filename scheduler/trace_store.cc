#include "scheduler/trace_store.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/status.h"

namespace tessera {

TraceStore::TraceStore(int max_instances) : max_instances_(max_instances) {
  TESSERA_CHECK(max_instances >= 1);
}

std::shared_ptr<const TraceStore::Labels> TraceStore::LabelsFor(
    uint64_t graph, const std::vector<TaskSpec>* tasks, const std::vector<ObjectSpec>* objects) {
  if (tasks == nullptr || objects == nullptr) return std::make_shared<const Labels>();
  auto cached = labels_.find(graph);
  if (cached != labels_.end()) {
    if (std::shared_ptr<const Labels> labels = cached->second.lock()) return labels;
  }
  auto labels = std::make_shared<Labels>();
  labels->tasks.reserve(tasks->size());
  for (const TaskSpec& task : *tasks) {
    labels->tasks.push_back(
        Labels::Task{task.name, task.layer, task.op, ClassifyTask(task.name, task.op)});
  }
  labels->objects.reserve(objects->size());
  for (const ObjectSpec& object : *objects) labels->objects.push_back(object.name);
  labels_[graph] = labels;
  return labels;
}

void TraceStore::Record(WorkerId worker, uint64_t graph, uint64_t instance,
                        const WorkerSpans& spans, const std::vector<TaskSpec>* tasks,
                        const std::vector<ObjectSpec>* objects, bool submitted) {
  Keep(worker, graph, instance, PackSpans(spans), tasks, objects, submitted);
}

Status TraceStore::RecordPacked(WorkerId worker, uint64_t graph, uint64_t instance,
                                std::string_view packed, const std::vector<TaskSpec>* tasks,
                                const std::vector<ObjectSpec>* objects, bool submitted) {
  TESSERA_RETURN_IF_ERROR(CheckPackedSpans(packed));
  Keep(worker, graph, instance, std::string(packed), tasks, objects, submitted);
  return Status::Ok();
}

void TraceStore::Keep(WorkerId worker, uint64_t graph, uint64_t instance, std::string packed,
                      const std::vector<TaskSpec>* tasks, const std::vector<ObjectSpec>* objects,
                      bool submitted) {
  std::deque<Instance>& kept = submitted ? submitted_ : instances_;
  Index& index = submitted ? submitted_index_ : instances_index_;
  const size_t most = submitted ? kSubmittedInstances : static_cast<size_t>(max_instances_);
  auto [found, added] = index.try_emplace({graph, instance}, nullptr);
  if (added) {
    found->second =
        &kept.emplace_back(Instance{graph, instance, LabelsFor(graph, tasks, objects), {}});
    while (kept.size() > most) {
      index.erase({kept.front().graph, kept.front().instance});
      kept.pop_front();
    }
    // Labels of graphs no kept instance uses any more.
    std::erase_if(labels_, [](const auto& entry) { return entry.second.expired(); });
  }
  found->second->workers.emplace_back(worker, std::move(packed));
}

std::vector<TimelineSpan> TraceStore::Collect(
    int last, uint64_t graph, const std::function<bool(uint64_t, uint64_t)>& running) const {
  std::vector<const Instance*> chosen;
  for (auto it = instances_.rbegin(); it != instances_.rend(); ++it) {
    if (last > 0 && static_cast<int>(chosen.size()) >= last) break;
    if (graph != 0 && it->graph != graph) continue;
    if (running && running(it->graph, it->instance)) continue;
    chosen.push_back(&*it);
  }
  std::reverse(chosen.begin(), chosen.end());
  if (graph == 0) {  // with the steps, the submitted tasks' latest instances
    for (const Instance& instance : submitted_) {
      if (!running || !running(instance.graph, instance.instance)) chosen.push_back(&instance);
    }
  }
  std::vector<TimelineSpan> spans;
  for (const Instance* instance : chosen) {
    const Labels& labels = *instance->labels;
    for (const auto& [worker, packed] : instance->workers) {
      // Checked when kept (RecordPacked) or packed here (Record).
      Result<WorkerSpans> unpacked = UnpackSpans(packed);
      if (!unpacked.ok()) continue;
      const WorkerSpans& recorded = *unpacked;
      for (const WorkerSpans::Task& task : recorded.tasks) {
        TimelineSpan span;
        span.worker = worker;
        span.stream = task.stream;
        if (task.task >= 1 && task.task <= labels.tasks.size()) {
          const Labels::Task& label = labels.tasks[task.task - 1];
          span.name = label.name;
          span.layer = label.layer;
          span.op = label.op;
          span.kind = label.kind;
        } else {
          span.name = fmt::format("task {}", task.task);
        }
        span.start_us = task.start_us;
        span.end_us = task.end_us;
        span.bytes = task.bytes;
        span.graph = instance->graph;
        span.instance = instance->instance;
        spans.push_back(std::move(span));
      }
      for (const WorkerSpans::Push& push : recorded.pushes) {
        TimelineSpan span;
        span.worker = worker;
        span.stream = kTransferStream;
        const std::string object = push.object >= 1 && push.object <= labels.objects.size()
                                       ? labels.objects[push.object - 1]
                                       : fmt::format("object {}", push.object);
        span.name = fmt::format("push {} to worker{}", object, push.destination);
        span.op = "push";
        span.kind = SpanKind::kTransfer;
        span.start_us = push.start_us;
        span.end_us = push.end_us;
        span.bytes = push.bytes;
        span.graph = instance->graph;
        span.instance = instance->instance;
        spans.push_back(std::move(span));
      }
    }
  }
  return spans;
}

}  // namespace tessera
