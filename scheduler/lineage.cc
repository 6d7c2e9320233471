#include "scheduler/lineage.h"

namespace tessera {

void Lineage::Record(const TaskSpec& spec, const std::vector<ObjectSpec>& outputs,
                     WorkerId driver) {
  LineageEntry& entry = entries_[spec.id];
  entry.spec = spec;
  entry.outputs = outputs;
  entry.driver = driver;
  entry.references = static_cast<int>(outputs.size());
  for (const ObjectSpec& output : outputs) producers_[output.id] = spec.id;
  for (ObjectId input : spec.inputs) {
    auto producer = producers_.find(input);
    if (producer != producers_.end()) ++entries_.at(producer->second).references;
  }
  if (entry.references == 0) Unref(spec.id);  // no outputs and nothing to keep
}

LineageEntry* Lineage::ProducerOf(ObjectId object) {
  auto producer = producers_.find(object);
  return producer == producers_.end() ? nullptr : &entries_.at(producer->second);
}

void Lineage::OutputFreed(ObjectId object) {
  auto producer = producers_.find(object);
  if (producer != producers_.end()) Unref(producer->second);
}

void Lineage::OutputRevived(ObjectId object) {
  auto producer = producers_.find(object);
  if (producer != producers_.end()) ++entries_.at(producer->second).references;
}

void Lineage::Unref(TaskId task) {
  // Iterative: a long chain let go at its end must not recurse once per link.
  std::vector<TaskId> dropping{task};
  while (!dropping.empty()) {
    const TaskId id = dropping.back();
    dropping.pop_back();
    auto it = entries_.find(id);
    if (it == entries_.end() || --it->second.references > 0) continue;
    for (const ObjectSpec& output : it->second.outputs) producers_.erase(output.id);
    for (ObjectId input : it->second.spec.inputs) {
      auto producer = producers_.find(input);
      if (producer != producers_.end()) dropping.push_back(producer->second);
    }
    entries_.erase(it);
  }
}

}  // namespace tessera
