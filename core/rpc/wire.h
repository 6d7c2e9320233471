// Conversions between Tessera's C++ types and the wire schema (core/proto/tessera.capnp).
//
// Decoding is the second half of the validated decoding layer (wire_limits.h): it checks what a
// peer could get wrong or forge against `limits` before anything is sized or indexed by it:
// list lengths and text sizes (again, so each function is safe on its own), enum values in
// range, tensor ranks, dimensions and bytes (without overflow), attribute counts and sizes, a
// collective member's rank and group size, donation slots. It returns InvalidArgument naming
// the field, the value and the limit; malformed Cap'n Proto structure throws kj::Exception,
// which the connection layer turns into a closed connection.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/attrs.h"
#include "core/graph.h"
#include "core/proto/tessera.capnp.h"
#include "core/rpc/wire_limits.h"
#include "core/status.h"
#include "core/tensor.h"
#include "core/timeline.h"

namespace tessera::rpc {

// Bumped on incompatible changes to the schema or the protocol.
inline constexpr uint32_t kProtocolVersion = 5;

void ToWire(const TensorMeta& meta, proto::TensorMeta::Builder out);
// InvalidArgument for a rank above limits.max_tensor_rank, a negative dimension, an unknown dtype
// or device kind, or more than limits.max_tensor_bytes.
Result<TensorMeta> FromWire(proto::TensorMeta::Reader in, const WireLimits& limits = {});

void ToWire(const Attrs& attrs, capnp::List<proto::Attr>::Builder out);
// InvalidArgument for more than limits.max_attrs attributes, a name or value over its limit, or
// an unknown value type.
Result<Attrs> FromWire(capnp::List<proto::Attr>::Reader in, const WireLimits& limits = {});

void ToWire(const Status& status, proto::Error::Builder out);
Status FromWire(proto::Error::Reader in);

void ToWire(const ObjectSpec& object, proto::ObjectDecl::Builder out);
Result<ObjectSpec> FromWire(proto::ObjectDecl::Reader in, const WireLimits& limits = {});

// A task with its output objects' declarations (taken from `graph`, or `outputs` when given).
void ToWire(const TaskSpec& task, const std::vector<ObjectSpec>& outputs, proto::Task::Builder out);
struct WireTask {
  TaskSpec spec;
  std::vector<ObjectSpec> outputs;
};
// InvalidArgument, besides the checks above and CheckTask's, for a collective member whose
// attributes CollectiveOf refuses (core/collective_task.h) or whose group is larger than
// limits.max_group_size, a donation of a slot the task does not have, a memory estimate outside
// [0, limits.max_tensor_bytes] or an unknown device kind.
Result<WireTask> FromWire(proto::Task::Reader in, const WireLimits& limits = {});

// A worker's spans of one instance, packed (core/timeline.h PackSpans). InvalidArgument for a
// damaged packing, an unknown stream, a span that ends before it starts or lies outside
// [0, 2^60] us, negative bytes, or more than limits.max_objects spans of a kind.
void ToWire(const WorkerSpans& spans, proto::InstanceSpans::Builder out);
Result<WorkerSpans> FromWire(proto::InstanceSpans::Reader in, const WireLimits& limits = {});
// The packing as it lies in the message (valid while the message is), not checked: for a
// receiver that keeps it as it is (core/timeline.h CheckPackedSpans checks it).
std::string_view PackedSpansOf(proto::InstanceSpans::Reader in);

// The scheduler's answer to a TimelineRequest. InvalidArgument for an unknown span kind or
// stream, and for lists or names over their limits.
void ToWire(const Timeline& timeline, proto::Timeline::Builder out);
Result<Timeline> FromWire(proto::Timeline::Reader in, const WireLimits& limits = {});

inline std::string ToString(capnp::Text::Reader text) {
  return std::string(text.cStr(), text.size());
}

}  // namespace tessera::rpc
