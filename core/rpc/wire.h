// Conversions between Tessera's C++ types and the wire schema (core/proto/tessera.capnp).
//
// Decoding validates what a peer could get wrong or forge: enum values in range, ranks and
// dimensions sane. It returns InvalidArgument for bad values; malformed Cap'n Proto structure
// throws kj::Exception, which the connection layer turns into a closed connection.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/attrs.h"
#include "core/graph.h"
#include "core/proto/tessera.capnp.h"
#include "core/status.h"
#include "core/tensor.h"
#include "core/timeline.h"

namespace tessera::rpc {

// Bumped on incompatible changes to the schema or the protocol.
inline constexpr uint32_t kProtocolVersion = 3;

void ToWire(const TensorMeta& meta, proto::TensorMeta::Builder out);
Result<TensorMeta> FromWire(proto::TensorMeta::Reader in);

void ToWire(const Attrs& attrs, capnp::List<proto::Attr>::Builder out);
Result<Attrs> FromWire(capnp::List<proto::Attr>::Reader in);

void ToWire(const Status& status, proto::Error::Builder out);
Status FromWire(proto::Error::Reader in);

void ToWire(const ObjectSpec& object, proto::ObjectDecl::Builder out);
Result<ObjectSpec> FromWire(proto::ObjectDecl::Reader in);

// A task with its output objects' declarations (taken from `graph`, or `outputs` when given).
void ToWire(const TaskSpec& task, const std::vector<ObjectSpec>& outputs, proto::Task::Builder out);
struct WireTask {
  TaskSpec spec;
  std::vector<ObjectSpec> outputs;
};
Result<WireTask> FromWire(proto::Task::Reader in);

// A worker's spans of one instance, packed (core/timeline.h PackSpans). InvalidArgument for a
// damaged packing, an unknown stream, a span that ends before it starts, or negative bytes.
void ToWire(const WorkerSpans& spans, proto::InstanceSpans::Builder out);
Result<WorkerSpans> FromWire(proto::InstanceSpans::Reader in);
// The packing as it lies in the message (valid while the message is), not checked: for a
// receiver that keeps it as it is (core/timeline.h CheckPackedSpans checks it).
std::string_view PackedSpansOf(proto::InstanceSpans::Reader in);

// The scheduler's answer to a TimelineRequest. InvalidArgument for an unknown span kind or
// stream.
void ToWire(const Timeline& timeline, proto::Timeline::Builder out);
Result<Timeline> FromWire(proto::Timeline::Reader in);

inline std::string ToString(capnp::Text::Reader text) {
  return std::string(text.cStr(), text.size());
}

}  // namespace tessera::rpc
