#include "core/rpc/wire.h"

#include <optional>

#include "core/collective_task.h"

namespace tessera::rpc {

void ToWire(const TensorMeta& meta, proto::TensorMeta::Builder out) {
  auto shape = out.initShape(static_cast<unsigned>(meta.shape.rank()));
  for (int i = 0; i < meta.shape.rank(); ++i) shape.set(static_cast<unsigned>(i), meta.shape[i]);
  out.setDtype(static_cast<uint8_t>(meta.dtype));
  out.setDeviceKind(static_cast<uint8_t>(meta.device.kind));
  out.setDeviceIndex(static_cast<int16_t>(meta.device.index));
}

Result<TensorMeta> FromWire(proto::TensorMeta::Reader in, const WireLimits& limits) {
  TensorMeta meta;
  const auto shape = in.getShape();
  if (shape.size() > limits.max_tensor_rank) {
    return InvalidArgument("tensor rank {} exceeds {}", shape.size(), limits.max_tensor_rank);
  }
  if (in.getDtype() > static_cast<uint8_t>(DType::kU16)) {
    return InvalidArgument("unknown dtype {} on the wire", in.getDtype());
  }
  meta.dtype = static_cast<DType>(in.getDtype());
  std::vector<int64_t> dims;
  dims.reserve(shape.size());
  for (int64_t d : shape) {
    if (d < 0) return InvalidArgument("negative dimension {} on the wire", d);
    dims.push_back(d);
  }
  // The bytes, checked before any product can overflow: numel * size <= max_tensor_bytes.
  const int64_t most_elements = limits.max_tensor_bytes / DTypeSize(meta.dtype);
  int64_t numel = 1;
  for (int64_t d : dims) {
    if (d != 0 && numel > most_elements / d) {
      return InvalidArgument(
          "tensor of shape {} ({}) holds more than the limit of {} bytes "
          "(TESSERA_WIRE_MAX_TENSOR_BYTES)",
          Shape(dims).ToString(), DTypeName(meta.dtype), limits.max_tensor_bytes);
    }
    numel *= d;
  }
  meta.shape = Shape(std::move(dims));
  if (in.getDeviceKind() > static_cast<uint8_t>(DeviceKind::kDisk)) {
    return InvalidArgument("unknown device kind {} on the wire", in.getDeviceKind());
  }
  meta.device = Device{static_cast<DeviceKind>(in.getDeviceKind()), in.getDeviceIndex()};
  return meta;
}

void ToWire(const Attrs& attrs, capnp::List<proto::Attr>::Builder out) {
  unsigned i = 0;
  for (const auto& [name, value] : attrs.values()) {
    proto::Attr::Builder attr = out[i++];
    attr.setName(name);
    auto v = attr.initValue();
    if (const int64_t* x = std::get_if<int64_t>(&value)) {
      v.setInt(*x);
    } else if (const double* f = std::get_if<double>(&value)) {
      v.setFloat(*f);
    } else if (const std::string* s = std::get_if<std::string>(&value)) {
      v.setText(*s);
    } else {
      const auto& ints = std::get<std::vector<int64_t>>(value);
      auto list = v.initInts(static_cast<unsigned>(ints.size()));
      for (unsigned j = 0; j < ints.size(); ++j) list.set(j, ints[j]);
    }
  }
}

Result<Attrs> FromWire(capnp::List<proto::Attr>::Reader in, const WireLimits& limits) {
  TESSERA_RETURN_IF_ERROR(CheckCount("task attrs", in.size(), limits.max_attrs));
  Attrs attrs;
  for (proto::Attr::Reader attr : in) {
    TESSERA_RETURN_IF_ERROR(CheckBytes("attribute name", attr.getName().size(),
                                       limits.max_name_bytes, "TESSERA_WIRE_MAX_NAME_BYTES"));
    const std::string name = ToString(attr.getName());
    auto value = attr.getValue();
    switch (value.which()) {
      case proto::Attr::Value::INT:
        attrs.Set(name, value.getInt());
        break;
      case proto::Attr::Value::FLOAT:
        attrs.Set(name, value.getFloat());
        break;
      case proto::Attr::Value::TEXT:
        TESSERA_RETURN_IF_ERROR(CheckBytes(fmt::format("attribute '{}'", name),
                                           value.getText().size(), limits.max_attr_bytes,
                                           "TESSERA_WIRE_MAX_ATTR_BYTES"));
        attrs.Set(name, ToString(value.getText()));
        break;
      case proto::Attr::Value::INTS: {
        TESSERA_RETURN_IF_ERROR(CheckCount(fmt::format("attribute '{}'", name),
                                           value.getInts().size(), limits.max_attr_bytes / 8,
                                           "TESSERA_WIRE_MAX_ATTR_BYTES"));
        std::vector<int64_t> ints;
        ints.reserve(value.getInts().size());
        for (int64_t x : value.getInts()) ints.push_back(x);
        attrs.Set(name, std::move(ints));
        break;
      }
      default:
        return InvalidArgument("attribute '{}' has an unknown type", name);
    }
  }
  return attrs;
}

void ToWire(const Status& status, proto::Error::Builder out) {
  out.setCode(static_cast<uint8_t>(status.code()));
  out.setMessage(status.message());
}

Status FromWire(proto::Error::Reader in) {
  if (in.getCode() == 0 || in.getCode() > static_cast<uint8_t>(StatusCode::kInternal)) {
    return Internal("peer sent error code {}: {}", in.getCode(), ToString(in.getMessage()));
  }
  return Status(static_cast<StatusCode>(in.getCode()), ToString(in.getMessage()));
}

void ToWire(const ObjectSpec& object, proto::ObjectDecl::Builder out) {
  out.setId(object.id.value());
  out.setName(object.name);
  ToWire(object.meta, out.initMeta());
  out.setRole(static_cast<uint8_t>(object.role));
}

Result<ObjectSpec> FromWire(proto::ObjectDecl::Reader in, const WireLimits& limits) {
  TESSERA_RETURN_IF_ERROR(CheckObjectDecl(in, limits));
  ObjectSpec object;
  object.id = ObjectId(in.getId());
  object.name = ToString(in.getName());
  TESSERA_ASSIGN_OR_RETURN(object.meta, FromWire(in.getMeta(), limits));
  if (in.getRole() > static_cast<uint8_t>(kLastObjectRole)) {
    return InvalidArgument("object '{}' has unknown role {}", object.name, in.getRole());
  }
  object.role = static_cast<ObjectRole>(in.getRole());
  return object;
}

void ToWire(const TaskSpec& task, const std::vector<ObjectSpec>& outputs,
            proto::Task::Builder out) {
  out.setId(task.id.value());
  out.setName(task.name);
  out.setLayer(task.layer);
  out.setOp(task.op);
  ToWire(task.attrs, out.initAttrs(static_cast<unsigned>(task.attrs.values().size())));
  auto inputs = out.initInputs(static_cast<unsigned>(task.inputs.size()));
  for (unsigned i = 0; i < task.inputs.size(); ++i) inputs.set(i, task.inputs[i].value());
  auto decls = out.initOutputs(static_cast<unsigned>(outputs.size()));
  for (unsigned i = 0; i < outputs.size(); ++i) ToWire(outputs[i], decls[i]);
  out.setPinnedWorker(task.pinned_worker.value());
  out.setPriority(task.priority);
  out.setMemoryEstimate(task.memory_estimate_bytes);
  auto donations = out.initDonations(static_cast<unsigned>(task.donations.size()));
  for (unsigned i = 0; i < task.donations.size(); ++i) {
    donations[i].setInput(static_cast<uint16_t>(task.donations[i].input_index));
    donations[i].setOutput(static_cast<uint16_t>(task.donations[i].output_index));
  }
  auto after = out.initAfter(static_cast<unsigned>(task.after.size()));
  for (unsigned i = 0; i < task.after.size(); ++i) after.set(i, task.after[i].value());
  out.setDeviceKind(static_cast<uint8_t>(task.device_kind));
}

namespace {

// A collective member's attributes, checked before anything is sized by its group: CollectiveOf's
// checks (a rank in the group, at most kMaxCollectiveGroupSize members), then the cluster's limit.
Status CheckMembership(const TaskSpec& spec, const WireLimits& limits) {
  TESSERA_ASSIGN_OR_RETURN(std::optional<CollectiveMembership> membership, CollectiveOf(spec));
  if (membership && membership->group_size > limits.max_group_size) {
    return InvalidArgument(
        "collective task '{}': group_size {} is more than the limit of {} "
        "(TESSERA_WIRE_MAX_GROUP_SIZE)",
        spec.name, membership->group_size, limits.max_group_size);
  }
  return Status::Ok();
}

}  // namespace

Result<WireTask> FromWire(proto::Task::Reader in, const WireLimits& limits) {
  TESSERA_RETURN_IF_ERROR(CheckTask(in, limits));
  WireTask task;
  TaskSpec& spec = task.spec;
  spec.id = TaskId(in.getId());
  spec.name = ToString(in.getName());
  spec.layer = ToString(in.getLayer());
  spec.op = ToString(in.getOp());
  TESSERA_ASSIGN_OR_RETURN(spec.attrs, FromWire(in.getAttrs(), limits));
  TESSERA_RETURN_IF_ERROR(CheckMembership(spec, limits));
  spec.inputs.reserve(in.getInputs().size());
  for (uint64_t input : in.getInputs()) spec.inputs.push_back(ObjectId(input));
  for (proto::ObjectDecl::Reader decl : in.getOutputs()) {
    TESSERA_ASSIGN_OR_RETURN(ObjectSpec object, FromWire(decl, limits));
    object.producer = spec.id;
    spec.outputs.push_back(object.id);
    task.outputs.push_back(std::move(object));
  }
  spec.pinned_worker = WorkerId(in.getPinnedWorker());
  spec.priority = in.getPriority();
  spec.memory_estimate_bytes = in.getMemoryEstimate();
  // Summed into the workers' loads: bounded, so no sum of them overflows.
  if (spec.memory_estimate_bytes < 0 || spec.memory_estimate_bytes > limits.max_tensor_bytes) {
    return InvalidArgument(
        "task '{}' estimates {} bytes of memory, outside [0, {}] (TESSERA_WIRE_MAX_TENSOR_BYTES)",
        spec.name, spec.memory_estimate_bytes, limits.max_tensor_bytes);
  }
  for (proto::Donation::Reader donation : in.getDonations()) {
    if (donation.getInput() >= spec.inputs.size() || donation.getOutput() >= spec.outputs.size()) {
      return InvalidArgument("task '{}' donates a slot it does not have", spec.name);
    }
    spec.donations.push_back(Donation{donation.getInput(), donation.getOutput()});
  }
  for (uint64_t earlier : in.getAfter()) spec.after.push_back(TaskId(earlier));
  if (in.getDeviceKind() > static_cast<uint8_t>(DeviceKind::kCuda)) {
    return InvalidArgument("task '{}' runs on unknown device kind {}", spec.name,
                           in.getDeviceKind());
  }
  spec.device_kind = static_cast<DeviceKind>(in.getDeviceKind());
  return task;
}

namespace {

// Span times are microseconds since the Unix epoch; readers subtract them from each other (a
// trace's origin), so they are bounded: no difference of two overflows.
Status CheckSpan(int stream, int64_t start_us, int64_t end_us, int64_t bytes) {
  if (stream < kCollectiveStream) return InvalidArgument("unknown stream {} on the wire", stream);
  if (end_us < start_us) {
    return InvalidArgument("span ends ({} us) before it starts ({} us)", end_us, start_us);
  }
  if (start_us < 0 || end_us > kMaxSpanMicros) {
    return InvalidArgument("span [{}, {}] us is outside [0, {}]", start_us, end_us, kMaxSpanMicros);
  }
  if (bytes < 0) return InvalidArgument("span of {} bytes on the wire", bytes);
  return Status::Ok();
}

}  // namespace

void ToWire(const WorkerSpans& spans, proto::InstanceSpans::Builder out) {
  const std::string packed = PackSpans(spans);
  out.setPacked(
      capnp::Data::Reader(reinterpret_cast<const kj::byte*>(packed.data()), packed.size()));
}

std::string_view PackedSpansOf(proto::InstanceSpans::Reader in) {
  const capnp::Data::Reader packed = in.getPacked();
  return {reinterpret_cast<const char*>(packed.begin()), packed.size()};
}

Result<WorkerSpans> FromWire(proto::InstanceSpans::Reader in, const WireLimits& limits) {
  // The counts first, before anything is sized by them.
  TESSERA_ASSIGN_OR_RETURN(const PackedSpanCounts counts, CountPackedSpans(PackedSpansOf(in)));
  TESSERA_RETURN_IF_ERROR(
      CheckCount("spans.tasks", counts.tasks, limits.max_objects, "TESSERA_WIRE_MAX_OBJECTS"));
  TESSERA_RETURN_IF_ERROR(
      CheckCount("spans.pushes", counts.pushes, limits.max_objects, "TESSERA_WIRE_MAX_OBJECTS"));
  return UnpackSpans(PackedSpansOf(in));
}

void ToWire(const Timeline& timeline, proto::Timeline::Builder out) {
  auto processes = out.initProcesses(static_cast<unsigned>(timeline.processes.size()));
  for (unsigned i = 0; i < processes.size(); ++i) {
    const TimelineProcess& process = timeline.processes[i];
    processes[i].setWorker(process.worker.value());
    processes[i].setHostname(process.hostname);
    processes[i].setPid(process.pid);
  }
  auto spans = out.initSpans(static_cast<unsigned>(timeline.spans.size()));
  for (unsigned i = 0; i < spans.size(); ++i) {
    const TimelineSpan& span = timeline.spans[i];
    spans[i].setWorker(span.worker.value());
    spans[i].setStream(static_cast<int16_t>(span.stream));
    spans[i].setName(span.name);
    spans[i].setLayer(span.layer);
    spans[i].setOp(span.op);
    spans[i].setKind(static_cast<uint8_t>(span.kind));
    spans[i].setStartMicros(span.start_us);
    spans[i].setEndMicros(span.end_us);
    spans[i].setBytes(span.bytes);
    spans[i].setGraphId(span.graph);
    spans[i].setInstance(span.instance);
  }
}

Result<Timeline> FromWire(proto::Timeline::Reader in, const WireLimits& limits) {
  TESSERA_RETURN_IF_ERROR(CheckCount("Timeline.processes", in.getProcesses().size(),
                                     limits.max_objects, "TESSERA_WIRE_MAX_OBJECTS"));
  TESSERA_RETURN_IF_ERROR(CheckCount("Timeline.spans", in.getSpans().size(), limits.max_objects,
                                     "TESSERA_WIRE_MAX_OBJECTS"));
  Timeline timeline;
  for (proto::TimelineProcess::Reader process : in.getProcesses()) {
    timeline.processes.push_back(TimelineProcess{
        WorkerId(process.getWorker()), ToString(process.getHostname()), process.getPid()});
  }
  timeline.spans.reserve(in.getSpans().size());
  for (proto::TimelineSpan::Reader wire : in.getSpans()) {
    TESSERA_RETURN_IF_ERROR(
        CheckSpan(wire.getStream(), wire.getStartMicros(), wire.getEndMicros(), wire.getBytes()));
    if (wire.getKind() >= kSpanKinds) {
      return InvalidArgument("unknown span kind {} on the wire", wire.getKind());
    }
    TimelineSpan span;
    span.worker = WorkerId(wire.getWorker());
    span.stream = wire.getStream();
    span.name = ToString(wire.getName());
    span.layer = ToString(wire.getLayer());
    span.op = ToString(wire.getOp());
    span.kind = static_cast<SpanKind>(wire.getKind());
    span.start_us = wire.getStartMicros();
    span.end_us = wire.getEndMicros();
    span.bytes = wire.getBytes();
    span.graph = wire.getGraphId();
    span.instance = wire.getInstance();
    timeline.spans.push_back(std::move(span));
  }
  return timeline;
}

}  // namespace tessera::rpc
