// Tasks that reach the disk tier: those that read or write an object on Device::Disk() (a CPU
// worker's swap file, worker/swap_file.h). The executor runs them on its I/O thread, beside the
// compute (worker/in_process_executor.h); the memory model and the step-time prediction count
// them so (planner/memory_model.h, planner/step_time.h).
#pragma once

#include <algorithm>

#include "core/graph.h"

namespace tessera {

inline bool TouchesDisk(const Graph& graph, const TaskSpec& task) {
  const auto on_disk = [&graph](ObjectId id) {
    return graph.object(id).meta.device.kind == DeviceKind::kDisk;
  };
  return std::any_of(task.inputs.begin(), task.inputs.end(), on_disk) ||
         std::any_of(task.outputs.begin(), task.outputs.end(), on_disk);
}

}  // namespace tessera
