#include "core/graph.h"

#include <algorithm>
#include <queue>
#include <unordered_set>

namespace tessera {

std::string_view ObjectRoleName(ObjectRole role) {
  switch (role) {
    case ObjectRole::kInput:
      return "input";
    case ObjectRole::kParameter:
      return "parameter";
    case ObjectRole::kGradient:
      return "gradient";
    case ObjectRole::kOptimizerState:
      return "optimizer_state";
    case ObjectRole::kActivation:
      return "activation";
    case ObjectRole::kGatheredParameter:
      return "gathered_parameter";
    case ObjectRole::kGradientBucket:
      return "gradient_bucket";
    case ObjectRole::kOutput:
      return "output";
  }
  return "?";
}

ObjectId Graph::AddObject(std::string name, TensorMeta meta, ObjectRole role) {
  ObjectId id(objects_.size() + 1);
  objects_.push_back(ObjectSpec{id, std::move(name), std::move(meta), role, TaskId()});
  return id;
}

TaskId Graph::AddTask(TaskSpec spec) {
  TaskId id(tasks_.size() + 1);
  spec.id = id;
  for (ObjectId output : spec.outputs) {
    TESSERA_CHECK(output.valid() && output.value() <= objects_.size(), "task {} output {}",
                  spec.name, output.ToString());
    ObjectSpec& object = objects_[output.value() - 1];
    TESSERA_CHECK(!object.producer.valid(), "object {} already produced by {}", object.name,
                  object.producer.ToString());
    object.producer = id;
  }
  tasks_.push_back(std::move(spec));
  return id;
}

void Graph::MarkOutput(ObjectId id) {
  if (!IsOutput(id)) outputs_.push_back(id);
}

void Graph::AddControlEdge(TaskId earlier, TaskId later) {
  TESSERA_CHECK(earlier.valid() && earlier.value() <= tasks_.size() && later.valid() &&
                    later.value() <= tasks_.size(),
                "control edge between unknown tasks {} -> {}", earlier.ToString(),
                later.ToString());
  std::vector<TaskId>& after = tasks_[later.value() - 1].after;
  if (std::find(after.begin(), after.end(), earlier) == after.end()) after.push_back(earlier);
}

bool Graph::IsOutput(ObjectId id) const {
  return std::find(outputs_.begin(), outputs_.end(), id) != outputs_.end();
}

const ObjectSpec& Graph::object(ObjectId id) const {
  TESSERA_CHECK(id.valid() && id.value() <= objects_.size(), "unknown {}", id.ToString());
  return objects_[id.value() - 1];
}

const TaskSpec& Graph::task(TaskId id) const {
  TESSERA_CHECK(id.valid() && id.value() <= tasks_.size(), "unknown {}", id.ToString());
  return tasks_[id.value() - 1];
}

std::vector<ObjectId> Graph::InputObjects() const {
  std::vector<ObjectId> inputs;
  for (const ObjectSpec& object : objects_) {
    if (!object.producer.valid()) inputs.push_back(object.id);
  }
  return inputs;
}

Result<ObjectId> Graph::FindObject(std::string_view name) const {
  for (const ObjectSpec& object : objects_) {
    if (object.name == name) return object.id;
  }
  return NotFound("graph has no object named '{}'", name);
}

Result<TaskId> Graph::FindTask(std::string_view name) const {
  for (const TaskSpec& task : tasks_) {
    if (task.name == name) return task.id;
  }
  return NotFound("graph has no task named '{}'", name);
}

int64_t Graph::BytesOfRole(ObjectRole role) const {
  int64_t bytes = 0;
  for (const ObjectSpec& object : objects_) {
    if (object.role == role) bytes += object.meta.bytes();
  }
  return bytes;
}

Status Graph::Validate() const {
  auto valid_object = [&](ObjectId id) { return id.valid() && id.value() <= objects_.size(); };
  std::unordered_set<std::string_view> names;
  for (const ObjectSpec& object : objects_) {
    if (!names.insert(object.name).second) {
      return InvalidArgument("two objects are named '{}'", object.name);
    }
  }
  names.clear();
  for (const TaskSpec& task : tasks_) {
    if (!names.insert(task.name).second) {
      return InvalidArgument("two tasks are named '{}'", task.name);
    }
    if (task.op.empty()) return InvalidArgument("task '{}' has no op", task.name);
    for (ObjectId input : task.inputs) {
      if (!valid_object(input)) {
        return InvalidArgument("task '{}' reads unknown object {}", task.name, input.ToString());
      }
    }
    for (ObjectId output : task.outputs) {
      if (!valid_object(output) || object(output).producer != task.id) {
        return InvalidArgument("task '{}' output {} is not produced by it", task.name,
                               output.ToString());
      }
    }
    for (const Donation& donation : task.donations) {
      if (donation.input_index < 0 ||
          donation.input_index >= static_cast<int>(task.inputs.size()) ||
          donation.output_index < 0 ||
          donation.output_index >= static_cast<int>(task.outputs.size())) {
        return InvalidArgument("task '{}' donates input #{} to output #{}: no such slot", task.name,
                               donation.input_index, donation.output_index);
      }
      const TensorMeta& in = object(task.inputs[donation.input_index]).meta;
      const TensorMeta& out = object(task.outputs[donation.output_index]).meta;
      if (in.bytes() != out.bytes() || in.device != out.device) {
        return InvalidArgument("task '{}' donates {} to {}: sizes or devices differ", task.name,
                               in.ToString(), out.ToString());
      }
    }
  }
  for (const TaskSpec& task : tasks_) {
    for (TaskId earlier : task.after) {
      if (!earlier.valid() || earlier.value() > tasks_.size() || earlier == task.id) {
        return InvalidArgument("task '{}' is after {}, which is not another task of the graph",
                               task.name, earlier.ToString());
      }
    }
  }
  for (ObjectId output : outputs_) {
    if (!valid_object(output)) {
      return InvalidArgument("graph output {} is not an object of the graph", output.ToString());
    }
  }
  return TopologicalOrder().status();
}

Result<std::vector<TaskId>> Graph::TopologicalOrder() const {
  const size_t n = tasks_.size();
  std::vector<int> pending(n, 0);
  std::vector<std::vector<size_t>> consumers(n);
  for (size_t t = 0; t < n; ++t) {
    for (ObjectId input : tasks_[t].inputs) {
      TaskId producer = object(input).producer;
      if (producer.valid()) {
        ++pending[t];
        consumers[producer.value() - 1].push_back(t);
      }
    }
    for (TaskId earlier : tasks_[t].after) {
      if (!earlier.valid() || earlier.value() > n) continue;  // Validate names it
      ++pending[t];
      consumers[earlier.value() - 1].push_back(t);
    }
  }
  // Max-heap on (priority, -index): higher priority first, then insertion order.
  auto later = [&](size_t a, size_t b) {
    if (tasks_[a].priority != tasks_[b].priority) return tasks_[a].priority < tasks_[b].priority;
    return a > b;
  };
  std::priority_queue<size_t, std::vector<size_t>, decltype(later)> ready(later);
  for (size_t t = 0; t < n; ++t) {
    if (pending[t] == 0) ready.push(t);
  }
  std::vector<TaskId> order;
  order.reserve(n);
  while (!ready.empty()) {
    size_t t = ready.top();
    ready.pop();
    order.push_back(tasks_[t].id);
    for (size_t consumer : consumers[t]) {
      if (--pending[consumer] == 0) ready.push(consumer);
    }
  }
  if (order.size() != n) {
    for (size_t t = 0; t < n; ++t) {
      if (pending[t] > 0) {
        return InvalidArgument("graph has a cycle through task '{}'", tasks_[t].name);
      }
    }
  }
  return order;
}

}  // namespace tessera
