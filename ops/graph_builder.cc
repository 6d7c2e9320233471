#include "ops/graph_builder.h"

namespace tessera {

namespace {

// Output i's name in the op's declaration ("out3" past the names of a variadic-output op).
std::string OutputName(const OpDef& def, size_t i) {
  if (i < def.output_names.size()) return def.output_names[i];
  return fmt::format("{}{}", def.output_names.empty() ? "out" : def.output_names.back(), i);
}

}  // namespace

ObjectId GraphBuilder::AddInput(std::string name, TensorMeta meta, ObjectRole role) {
  return graph_.AddObject(std::move(name), std::move(meta), role);
}

Result<std::vector<ObjectId>> GraphBuilder::AddTask(std::string name, const std::string& op,
                                                    std::vector<ObjectId> inputs, Attrs attrs,
                                                    TaskOptions options) {
  const std::string context = options.layer.empty()
                                  ? fmt::format("task '{}'", name)
                                  : fmt::format("task '{}' (layer {})", name, options.layer);
  std::vector<TensorMeta> input_metas;
  input_metas.reserve(inputs.size());
  for (ObjectId input : inputs) {
    if (!input.valid() || input.value() > static_cast<uint64_t>(graph_.num_objects())) {
      return InvalidArgument("{}: input {} is not an object of this graph", context,
                             input.ToString());
    }
    input_metas.push_back(graph_.object(input).meta);
  }
  Result<std::vector<TensorMeta>> output_metas = registry_.InferShapes(op, input_metas, attrs);
  if (!output_metas.ok()) return output_metas.status().WithContext(context);
  TESSERA_ASSIGN_OR_RETURN(const OpDef* def, registry_.Find(op));
  const Device device = options.device_kind == DeviceKind::kCpu ? Device::Cpu() : Device::Cuda(0);
  if (!def->crosses_devices) {
    for (ObjectId input : inputs) {
      const ObjectSpec& object = graph_.object(input);
      if (object.meta.device.kind != device.kind) {
        return InvalidArgument(
            "{}: op '{}' runs on {} but its input '{}' lives on {}; move it with a 'copy' task "
            "first",
            context, op, DeviceKindName(device.kind), object.name,
            DeviceKindName(object.meta.device.kind));
      }
    }
  }
  Device output_device = device;
  if (options.outputs_on_disk) {
    if (!def->crosses_devices || device.kind != DeviceKind::kCpu) {
      return InvalidArgument(
          "{}: only a CPU task of an op that moves objects between devices "
          "('copy') may put its outputs on the disk, not op '{}' on {}",
          context, op, DeviceKindName(device.kind));
    }
    output_device = Device::Disk();
  }
  for (TensorMeta& meta : *output_metas) meta.device = output_device;

  TaskSpec task;
  task.name = std::move(name);
  task.layer = std::move(options.layer);
  task.op = op;
  task.attrs = std::move(attrs);
  task.inputs = std::move(inputs);
  task.device_kind = options.device_kind;
  task.pinned_worker = options.pinned_worker;
  task.priority = options.priority;
  Result<int64_t> workspace = registry_.Workspace(op, input_metas, task.attrs);
  if (!workspace.ok()) return workspace.status().WithContext(context);
  task.workspace_bytes = *workspace;
  for (const auto& [input_index, output_index] : def->in_place) {
    task.donations.push_back(Donation{input_index, output_index});
  }
  for (size_t i = 0; i < output_metas->size(); ++i) {
    std::string object_name = i < options.output_names.size()
                                  ? std::move(options.output_names[i])
                                  : fmt::format("{}:{}", task.name, OutputName(*def, i));
    ObjectRole role =
        i < options.output_roles.size() ? options.output_roles[i] : ObjectRole::kActivation;
    const TensorMeta& meta = (*output_metas)[i];
    bool in_place = false;
    for (const Donation& donation : task.donations) in_place |= donation.output_index == int(i);
    if (!in_place) task.memory_estimate_bytes += meta.bytes();
    task.outputs.push_back(graph_.AddObject(std::move(object_name), meta, role));
  }
  std::vector<ObjectId> outputs = task.outputs;
  graph_.AddTask(std::move(task));
  return outputs;
}

Result<Graph> GraphBuilder::Build() {
  TESSERA_RETURN_IF_ERROR(graph_.Validate());
  return std::exchange(graph_, Graph());
}

}  // namespace tessera
