// The control plane's validated decoding layer (core/rpc/wire_limits.h, core/rpc/wire.h): every
// count, size, rank and index a peer controls is refused over its limit, with a message naming
// the field, the value and the limit.
#include <limits>
#include <string>
#include <vector>

#include <capnp/message.h>

#include "core/collective_task.h"
#include "core/rpc/wire.h"
#include "core/rpc/wire_limits.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

// The error's message, or "OK".
std::string MessageOf(const Status& status) { return status.ok() ? "OK" : status.message(); }

bool Names(const Status& status, const std::string& text) {
  return status.message().find(text) != std::string::npos;
}

TaskSpec Gelu(std::string name = "t") {
  TaskSpec spec;
  spec.id = TaskId(1);
  spec.name = std::move(name);
  spec.op = "gelu_forward";
  return spec;
}

// `task` on the wire (no outputs unless given), decoded against `limits`.
Result<rpc::WireTask> RoundTrip(const TaskSpec& task, const rpc::WireLimits& limits,
                                const std::vector<ObjectSpec>& outputs = {}) {
  capnp::MallocMessageBuilder message;
  auto wire = message.initRoot<proto::Task>();
  rpc::ToWire(task, outputs, wire);
  return rpc::FromWire(wire.asReader(), limits);
}

Result<TensorMeta> MetaRoundTrip(const std::vector<int64_t>& dims, DType dtype,
                                 const rpc::WireLimits& limits) {
  capnp::MallocMessageBuilder message;
  auto wire = message.initRoot<proto::TensorMeta>();
  auto shape = wire.initShape(static_cast<unsigned>(dims.size()));
  for (unsigned i = 0; i < dims.size(); ++i) shape.set(i, dims[i]);
  wire.setDtype(static_cast<uint8_t>(dtype));
  return rpc::FromWire(wire.asReader(), limits);
}

TEST(WireLimitsTest, TheDefaultsAreTheSettingsAndBadSettingsAreNamed) {
  const rpc::WireLimits defaults;
  const rpc::WireLimits from_settings = rpc::WireLimits::FromSettings(Settings{});
  EXPECT_EQ(from_settings.max_tasks, defaults.max_tasks);
  EXPECT_EQ(from_settings.max_objects, defaults.max_objects);
  EXPECT_EQ(from_settings.max_group_size, defaults.max_group_size);
  EXPECT_EQ(from_settings.max_tensor_bytes, defaults.max_tensor_bytes);
  EXPECT_EQ(from_settings.max_attr_bytes, defaults.max_attr_bytes);
  EXPECT_EQ(from_settings.max_name_bytes, defaults.max_name_bytes);
  EXPECT_OK(defaults.Check());
  Settings settings;
  settings.wire_max_tasks = 0;
  EXPECT_EQ(MessageOf(rpc::WireLimits::FromSettings(settings).Check()),
            "TESSERA_WIRE_MAX_TASKS is 0: a limit must be positive");
  settings = Settings{};
  settings.wire_max_group_size = 5000;
  EXPECT_EQ(MessageOf(rpc::WireLimits::FromSettings(settings).Check()),
            "TESSERA_WIRE_MAX_GROUP_SIZE is 5000, above the most any cluster holds (4096)");
}

TEST(WireLimitsTest, TheReportedGroupSizesAreRefusedBeforeAnythingIsSizedByThem) {
  const rpc::WireLimits limits;
  TaskSpec huge = Gelu("huge");
  huge.op = "all_reduce";
  huge.attrs = Attrs{{kCollectiveAttr, int64_t{1}},
                     {kRankAttr, int64_t{0}},
                     {kGroupSizeAttr, int64_t{2'000'000'000}}};
  Status refused = RoundTrip(huge, limits).status();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(MessageOf(refused),
            "collective task 'huge': a group of 2000000000 members is more than any cluster "
            "holds (at most 4096)");
  // 2^32 + 2 passes an int64 check and is 2 as an int; rank 2147483000 would index far past it.
  TaskSpec wrapping = huge;
  wrapping.name = "wrapping";
  wrapping.attrs = Attrs{{kCollectiveAttr, int64_t{1}},
                         {kRankAttr, int64_t{2147483000}},
                         {kGroupSizeAttr, int64_t{4294967298}}};
  refused = RoundTrip(wrapping, limits).status();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Names(refused, "4294967298")) << refused.ToString();
  // Within kMaxCollectiveGroupSize but above the cluster's setting.
  rpc::WireLimits small;
  small.max_group_size = 8;
  TaskSpec sixteen = huge;
  sixteen.name = "sixteen";
  sixteen.attrs.Set(kGroupSizeAttr, int64_t{16});
  EXPECT_EQ(MessageOf(RoundTrip(sixteen, small).status()),
            "collective task 'sixteen': group_size 16 is more than the limit of 8 "
            "(TESSERA_WIRE_MAX_GROUP_SIZE)");
  sixteen.attrs.Set(kGroupSizeAttr, int64_t{8});
  EXPECT_OK(RoundTrip(sixteen, small).status());
  // A rank outside its group.
  sixteen.attrs.Set(kRankAttr, int64_t{-1});
  EXPECT_EQ(MessageOf(RoundTrip(sixteen, small).status()),
            "collective task 'sixteen': rank -1 is not in a group of 8");
}

TEST(WireLimitsTest, TensorRanksAndBytesAreBoundedWithoutOverflow) {
  rpc::WireLimits limits;
  EXPECT_OK(MetaRoundTrip({4, 64, 768}, DType::kBF16, limits).status());
  EXPECT_EQ(MessageOf(MetaRoundTrip(std::vector<int64_t>(17, 1), DType::kF32, limits).status()),
            "tensor rank 17 exceeds 16");
  // 2^40 * 2^40 elements overflows int64: refused before the product is taken.
  const int64_t big = int64_t{1} << 40;
  EXPECT_EQ(MessageOf(MetaRoundTrip({big, big}, DType::kF32, limits).status()),
            "tensor of shape [1099511627776, 1099511627776] (f32) holds more than the limit of "
            "1099511627776 bytes (TESSERA_WIRE_MAX_TENSOR_BYTES)");
  limits.max_tensor_bytes = 1024;
  EXPECT_OK(MetaRoundTrip({256}, DType::kF32, limits).status());
  EXPECT_FALSE(MetaRoundTrip({257}, DType::kF32, limits).ok());
  EXPECT_TRUE(MetaRoundTrip({0, big, big}, DType::kF32, limits).ok()) << "no elements";
}

TEST(WireLimitsTest, NamesAttributesAndTaskListsAreBounded) {
  rpc::WireLimits limits;
  limits.max_name_bytes = 16;  // "gelu_forward" fits
  limits.max_attr_bytes = 64;
  limits.max_objects = 3;
  limits.max_tasks = 2;
  EXPECT_EQ(MessageOf(RoundTrip(Gelu("a-much-longer-name"), limits).status()),
            "task name is 18 bytes long, more than the limit of 16 (TESSERA_WIRE_MAX_NAME_BYTES)");
  TaskSpec task = Gelu();
  task.attrs = Attrs{{"mode", std::string(65, 'x')}};
  EXPECT_EQ(MessageOf(RoundTrip(task, limits).status()),
            "text attribute is 65 bytes long, more than the limit of 64 "
            "(TESSERA_WIRE_MAX_ATTR_BYTES)");
  task.attrs = Attrs{{"ranges", std::vector<int64_t>(9, 0)}};
  EXPECT_EQ(MessageOf(RoundTrip(task, limits).status()),
            "ints attribute has 9 entries, more than the limit of 8 (TESSERA_WIRE_MAX_ATTR_BYTES)");
  task.attrs = Attrs{};
  task.inputs = {ObjectId(1), ObjectId(2), ObjectId(3), ObjectId(4)};
  EXPECT_EQ(MessageOf(RoundTrip(task, limits).status()),
            "task inputs has 4 entries, more than the limit of 3 (TESSERA_WIRE_MAX_OBJECTS)");
  task.inputs = {};
  task.after = {TaskId(1), TaskId(2), TaskId(3)};
  EXPECT_EQ(MessageOf(RoundTrip(task, limits).status()),
            "task after has 3 entries, more than the limit of 2 (TESSERA_WIRE_MAX_TASKS)");
  task.after = {};
  task.memory_estimate_bytes = -1;
  EXPECT_EQ(MessageOf(RoundTrip(task, limits).status()),
            "task 't' estimates -1 bytes of memory, outside [0, 1099511627776] "
            "(TESSERA_WIRE_MAX_TENSOR_BYTES)");
  task.memory_estimate_bytes = std::numeric_limits<int64_t>::max();
  EXPECT_FALSE(RoundTrip(task, limits).ok()) << "summed into a worker's load: it would overflow";
  limits = rpc::WireLimits{};
  limits.max_attrs = 2;
  task = Gelu();
  task.attrs = Attrs{{"a", int64_t{1}}, {"b", int64_t{2}}, {"c", int64_t{3}}};
  EXPECT_EQ(MessageOf(RoundTrip(task, limits).status()),
            "task attrs has 3 entries, more than the limit of 2");
}

TEST(WireLimitsTest, EnvelopesAreCheckedByKindBeforeAnythingReadsThem) {
  rpc::WireLimits limits;
  limits.max_tasks = 2;
  limits.max_objects = 3;
  limits.max_name_bytes = 8;
  capnp::MallocMessageBuilder message;
  auto envelope = message.initRoot<proto::Envelope>();
  envelope.initBody().initSubmitTasks().initTasks(3);
  EXPECT_EQ(MessageOf(rpc::CheckEnvelope(envelope.asReader(), limits)),
            "SubmitTasks.tasks has 3 entries, more than the limit of 2 (TESSERA_WIRE_MAX_TASKS)");
  envelope.initBody().initReleaseObjects().initIds(4);
  EXPECT_EQ(
      MessageOf(rpc::CheckEnvelope(envelope.asReader(), limits)),
      "ReleaseObjects.ids has 4 entries, more than the limit of 3 (TESSERA_WIRE_MAX_OBJECTS)");
  envelope.initBody().initHello().setHostname("a-very-long-host");
  EXPECT_EQ(MessageOf(rpc::CheckEnvelope(envelope.asReader(), limits)),
            "Hello.hostname is 16 bytes long, more than the limit of 8 "
            "(TESSERA_WIRE_MAX_NAME_BYTES)");
  WorkerSpans four_pushes;
  four_pushes.pushes.resize(4);
  rpc::ToWire(four_pushes, envelope.initBody().initInstanceFinished().initSpans());
  EXPECT_EQ(MessageOf(rpc::CheckEnvelope(envelope.asReader(), limits)),
            "InstanceFinished.spans.pushes has 4 entries, more than the limit of 3 "
            "(TESSERA_WIRE_MAX_OBJECTS)");
  auto graph = envelope.initBody().initRegisterGraph();
  graph.initObjects(1)[0].initMeta().initShape(17);
  EXPECT_EQ(MessageOf(rpc::CheckEnvelope(envelope.asReader(), limits)),
            "RegisterGraph.objects: tensor shape has 17 entries, more than the limit of 16");
  limits.max_group_size = 2;
  envelope.initBody().initCollectivePeers().initBlobs(3);
  EXPECT_EQ(MessageOf(rpc::CheckEnvelope(envelope.asReader(), limits)),
            "CollectivePeers.blobs has 3 entries, more than the limit of 2 "
            "(TESSERA_WIRE_MAX_GROUP_SIZE)");
  envelope.initBody().initHeartbeat().setHostUsed(-1);
  EXPECT_EQ(MessageOf(rpc::CheckEnvelope(envelope.asReader(), limits)),
            "Heartbeat.hostUsed is -1 bytes, outside [0, 1125899906842624]");
  envelope.initBody().initHello().setHostCapacity(int64_t{1} << 51);
  EXPECT_EQ(MessageOf(rpc::CheckEnvelope(envelope.asReader(), limits)),
            "Hello.hostCapacity is 2251799813685248 bytes, outside [0, 1125899906842624]");
  envelope.initBody().initCollectiveFailed().setSilentMs(int64_t{1} << 62);
  EXPECT_EQ(MessageOf(rpc::CheckEnvelope(envelope.asReader(), limits)),
            "CollectiveFailed.silentMs is 4611686018427387904 ms, more than the limit of "
            "1099511627776");
  envelope.initBody().initRunGraph().initTaskNames(2);
  EXPECT_OK(rpc::CheckEnvelope(envelope.asReader(), limits));
}

TEST(WireLimitsTest, SpanTimesAreBoundedSoTheirDifferencesCannotOverflow) {
  const auto decode = [](int64_t start_us, int64_t end_us) {
    WorkerSpans spans;
    spans.tasks.push_back(WorkerSpans::Task{1, 0, start_us, end_us, 0});
    capnp::MallocMessageBuilder message;
    rpc::ToWire(spans, message.initRoot<proto::InstanceSpans>());
    return rpc::FromWire(message.getRoot<proto::InstanceSpans>().asReader()).status();
  };
  EXPECT_OK(decode(10, 20));
  EXPECT_OK(decode(0, kMaxSpanMicros));
  EXPECT_EQ(MessageOf(decode(-5, 20)),
            "packed spans: span [-5, 20] us is outside [0, 1152921504606846976]");
  EXPECT_EQ(MessageOf(decode(0, kMaxSpanMicros + 1)),
            "packed spans: span [0, 1152921504606846977] us is outside [0, 1152921504606846976]");
  EXPECT_FALSE(decode(std::numeric_limits<int64_t>::min(), 20).ok());
  EXPECT_FALSE(decode(0, std::numeric_limits<int64_t>::max()).ok());
}

TEST(WireLimitsTest, ACollectiveIsCheckedWithoutSizingAnythingByItsGroup) {
  // One member of a group of the largest size: the missing rank is named, and nothing of the
  // group's size was made to find it.
  TaskSpec member = Gelu("m0");
  member.op = "all_reduce";
  member.attrs = Attrs{{kCollectiveAttr, int64_t{5}},
                       {kRankAttr, int64_t{0}},
                       {kGroupSizeAttr, kMaxCollectiveGroupSize}};
  EXPECT_EQ(MessageOf(ValidateCollectives({member})),
            "collective 5 (all_reduce, 4096 ranks) has no member of rank 1");
  TaskSpec last = member;
  last.name = "m4095";
  last.attrs.Set(kRankAttr, kMaxCollectiveGroupSize - 1);
  EXPECT_EQ(MessageOf(ValidateCollectives({last, member})),
            "collective 5 (all_reduce, 4096 ranks) has no member of rank 1");
  TaskSpec twin = member;
  twin.name = "twin";
  EXPECT_EQ(MessageOf(ValidateCollectives({member, twin})),
            "collective 5: tasks 'm0' and 'twin' are both rank 0");
}

TEST(WireLimitsTest, AGraphWithTooManyCollectivesIsNotOrdered) {
  // Ordering costs memory quadratic in the collectives: their number is bounded first.
  std::vector<TaskSpec> tasks;
  for (size_t i = 0; i <= kMaxCollectivesPerGraph; ++i) {
    TaskSpec member = Gelu(fmt::format("m{}", i));
    member.id = TaskId(i + 1);
    member.op = "all_reduce";
    member.attrs = Attrs{{kCollectiveAttr, static_cast<int64_t>(i)},
                         {kRankAttr, int64_t{0}},
                         {kGroupSizeAttr, int64_t{1}}};
    tasks.push_back(std::move(member));
  }
  const auto no_producer = [](ObjectId) { return TaskId(); };
  EXPECT_EQ(MessageOf(OrderCollectives(tasks, no_producer).status()),
            "the graph has 4097 collectives, more than the limit of 4096");
  tasks.pop_back();
  EXPECT_OK(OrderCollectives(tasks, no_producer).status());
}

}  // namespace
}  // namespace tessera::testing
