// libFuzzer target: the control plane's decoding, from bytes to the scheduler's state machine.
//
// Each input runs against a fresh SchedulerCore (scheduler/scheduler_core.h) with two workers and
// a driver joined and one object put, driven as SchedulerService drives it: every message goes
// through the frame decoder (core/rpc/frame.h), is handled under CatchMalformed, and a sender
// whose message is refused is disconnected. The first byte of an input picks one of two modes:
//
//   raw (even)          the rest, after a sender byte, is a byte stream of frames: framing,
//                       Cap'n Proto's own checks and every handler behind them, byte by byte.
//   structured (odd)    the rest is a script of up to 24 steps. Each step's first bytes pick the
//                       sender and the message kind; the kind's fields (counts, ids, ranks,
//                       group sizes, shapes, names, attributes) are drawn from the next bytes,
//                       often from lists of values that matter (0, -1, 4096, 2^31, 2^32 + 2,
//                       INT64_MAX, ...). The message is built with Cap'n Proto's builders and
//                       framed, so every input gets past the framing into the handlers: this is
//                       what makes the fuzzer structure-aware. Steps also advance the clock
//                       (heartbeats expire: workers die) and disconnect participants.
//
// Findings are crashes and sanitizer reports (ASan, UBSan), TESSERA_CHECK aborts, and exceptions
// other than kj::Exception escaping a handler (CatchMalformed aborts on those: bugs). The seeds
// (TESSERA_FUZZ_WRITE_SEEDS, fuzz_util.h) are valid messages of every kind the scheduler accepts
// in raw mode, the two reported group_size attacks, and a structured script per kind.
#include <fuzzer/FuzzedDataProvider.h>

#include <array>
#include <chrono>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <capnp/message.h>

#include "core/collective_task.h"
#include "core/crypto.h"
#include "core/rpc/frame.h"
#include "core/rpc/wire.h"
#include "fuzz/fuzz_util.h"
#include "scheduler/scheduler_core.h"

namespace tessera::fuzz {
namespace {

using Body = proto::Envelope::Body;

class NullOutbox : public Outbox {
 public:
  // Building and framing what the core sends is part of what runs.
  void Send(WorkerId, capnp::MessageBuilder& message) override {
    bytes_ += rpc::EncodeFrame(message).size();
  }
  void Disconnect(WorkerId, const Status&) override {}

 private:
  size_t bytes_ = 0;
};

constexpr std::array<int64_t, 16> kInteresting = {0,
                                                  1,
                                                  2,
                                                  3,
                                                  -1,
                                                  4096,
                                                  4097,
                                                  2'000'000'000,
                                                  2147483000,
                                                  2147483647,
                                                  4294967296,
                                                  4294967298,
                                                  int64_t{1} << 40,
                                                  int64_t{1} << 62,
                                                  std::numeric_limits<int64_t>::max(),
                                                  std::numeric_limits<int64_t>::min()};

int64_t Int(FuzzedDataProvider& in) {
  if (in.ConsumeBool()) return kInteresting[in.ConsumeIntegralInRange<size_t>(0, 15)];
  return in.ConsumeIntegral<int64_t>();
}

// Mostly a small id (ids collide and refer to each other), sometimes any.
uint64_t Id(FuzzedDataProvider& in) {
  if (in.ConsumeIntegralInRange(0, 7) == 0) return in.ConsumeIntegral<uint64_t>();
  return in.ConsumeIntegralInRange<uint64_t>(0, 12);
}

// A graph id: a driver's (1..3) or one of the scheduler's first ones.
uint64_t GraphId(FuzzedDataProvider& in) {
  const uint64_t pick = in.ConsumeIntegralInRange<uint64_t>(0, 11);
  return pick < 4 ? pick : kFirstSchedulerGraphId + pick - 4;
}

std::string Text(FuzzedDataProvider& in, size_t most = 12) {
  return in.ConsumeRandomLengthString(most);
}

capnp::Data::Reader Bytes(const std::string& bytes) {
  return {reinterpret_cast<const kj::byte*>(bytes.data()), bytes.size()};
}

void FillMeta(FuzzedDataProvider& in, proto::TensorMeta::Builder meta) {
  const unsigned rank = in.ConsumeIntegralInRange<unsigned>(0, 3);
  auto shape = meta.initShape(in.ConsumeIntegralInRange(0, 15) == 0 ? 17 : rank);
  for (unsigned i = 0; i < shape.size(); ++i) {
    shape.set(i, in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(0, 4) : Int(in));
  }
  meta.setDtype(in.ConsumeIntegralInRange<uint8_t>(0, 7));
  meta.setDeviceKind(in.ConsumeIntegralInRange<uint8_t>(0, 2));
  meta.setDeviceIndex(in.ConsumeIntegral<int16_t>());
}

void FillDecl(FuzzedDataProvider& in, proto::ObjectDecl::Builder decl, uint64_t id) {
  decl.setId(in.ConsumeBool() ? id : Id(in));
  decl.setName(Text(in));
  FillMeta(in, decl.initMeta());
  decl.setRole(in.ConsumeIntegralInRange<uint8_t>(0, 12));
}

void FillAttrs(FuzzedDataProvider& in, capnp::List<proto::Attr>::Builder attrs) {
  constexpr std::array<const char*, 7> kNames = {
      kCollectiveAttr, kRankAttr, kGroupSizeAttr, kGroupAttr, kPositionAttr, "reduce", "axis"};
  for (unsigned i = 0; i < attrs.size(); ++i) {
    proto::Attr::Builder attr = attrs[i];
    attr.setName(in.ConsumeBool() ? std::string(kNames[in.ConsumeIntegralInRange<size_t>(0, 6)])
                                  : Text(in));
    auto value = attr.initValue();
    switch (in.ConsumeIntegralInRange(0, 5)) {
      case 0:
        value.setFloat(in.ConsumeFloatingPoint<double>());
        break;
      case 1:
        value.setText(Text(in));
        break;
      case 2: {
        auto ints = value.initInts(in.ConsumeIntegralInRange<unsigned>(0, 4));
        for (unsigned j = 0; j < ints.size(); ++j) ints.set(j, Int(in));
        break;
      }
      default:
        value.setInt(in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(0, 3) : Int(in));
    }
  }
}

// A collective member's attributes: collective, rank and group_size.
void FillMember(FuzzedDataProvider& in, capnp::List<proto::Attr>::Builder attrs) {
  attrs[0].setName(kCollectiveAttr);
  attrs[0].initValue().setInt(in.ConsumeIntegralInRange<int64_t>(1, 3));
  attrs[1].setName(kRankAttr);
  attrs[1].initValue().setInt(in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(0, 2)
                                               : Int(in));
  attrs[2].setName(kGroupSizeAttr);
  attrs[2].initValue().setInt(in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(1, 3)
                                               : Int(in));
}

void FillTask(FuzzedDataProvider& in, proto::Task::Builder task, uint64_t id) {
  constexpr std::array<const char*, 5> kOps = {"gelu_forward", "all_reduce", "all_gather",
                                               "matmul_forward", ""};
  task.setId(in.ConsumeBool() ? id : Id(in));
  task.setName(Text(in));
  task.setLayer(Text(in, 4));
  const bool member = in.ConsumeIntegralInRange(0, 2) == 0;
  task.setOp(member ? "all_reduce" : kOps[in.ConsumeIntegralInRange<size_t>(0, 4)]);
  if (member) {
    FillMember(in, task.initAttrs(3));
  } else {
    FillAttrs(in, task.initAttrs(in.ConsumeIntegralInRange<unsigned>(0, 3)));
  }
  auto inputs = task.initInputs(in.ConsumeIntegralInRange<unsigned>(0, 3));
  for (unsigned i = 0; i < inputs.size(); ++i) inputs.set(i, Id(in));
  auto outputs = task.initOutputs(in.ConsumeIntegralInRange<unsigned>(0, 2));
  for (unsigned i = 0; i < outputs.size(); ++i) FillDecl(in, outputs[i], 100 + id * 4 + i);
  task.setPinnedWorker(in.ConsumeIntegralInRange<uint64_t>(0, 5));
  task.setPriority(in.ConsumeIntegral<int32_t>());
  task.setMemoryEstimate(in.ConsumeBool() ? 0 : Int(in));
  auto donations = task.initDonations(in.ConsumeIntegralInRange<unsigned>(0, 1));
  for (unsigned i = 0; i < donations.size(); ++i) {
    donations[i].setInput(in.ConsumeIntegralInRange<uint16_t>(0, 3));
    donations[i].setOutput(in.ConsumeIntegralInRange<uint16_t>(0, 2));
  }
  auto after = task.initAfter(in.ConsumeIntegralInRange<unsigned>(0, 2));
  for (unsigned i = 0; i < after.size(); ++i) after.set(i, Id(in));
  task.setDeviceKind(in.ConsumeIntegralInRange<uint8_t>(0, 2));
}

void FillError(FuzzedDataProvider& in, proto::Error::Builder error) {
  error.setCode(in.ConsumeIntegralInRange<uint8_t>(0, 14));
  error.setMessage(Text(in));
}

// A plugin's library: the one the fuzzer's LoadPlugin often sends (so graphs can name a plugin
// the scheduler holds), or other bytes.
constexpr const char* kPluginLibrary =
    "\x7f"
    "ELF not really a library";

void FillRegisterGraph(FuzzedDataProvider& in, proto::RegisterGraph::Builder graph) {
  graph.setGraphId(GraphId(in));
  auto plugins = graph.initPlugins(in.ConsumeIntegralInRange<unsigned>(0, 2));
  for (unsigned i = 0; i < plugins.size(); ++i) {
    plugins[i].setName(Text(in));
    plugins[i].setSha256(in.ConsumeBool() ? Sha256Hex(kPluginLibrary) : Text(in));
  }
  auto objects = graph.initObjects(in.ConsumeIntegralInRange<unsigned>(0, 5));
  for (unsigned i = 0; i < objects.size(); ++i) FillDecl(in, objects[i], i + 1);
  auto tasks = graph.initTasks(in.ConsumeIntegralInRange<unsigned>(0, 4));
  for (unsigned i = 0; i < tasks.size(); ++i) FillTask(in, tasks[i], i + 1);
  auto outputs = graph.initOutputs(in.ConsumeIntegralInRange<unsigned>(0, 2));
  for (unsigned i = 0; i < outputs.size(); ++i) outputs.set(i, Id(in));
}

void FillRunGraph(FuzzedDataProvider& in, proto::RunGraph::Builder run) {
  run.setGraphId(GraphId(in));
  run.setInstance(Id(in));
  auto inputs = run.initInputs(in.ConsumeIntegralInRange<unsigned>(0, 3));
  for (unsigned i = 0; i < inputs.size(); ++i) {
    inputs[i].setObject(Id(in));
    inputs[i].initSource().setObject(Id(in));
    inputs[i].setTakeOver(in.ConsumeBool());
  }
  auto outputs = run.initOutputIds(in.ConsumeIntegralInRange<unsigned>(0, 3));
  for (unsigned i = 0; i < outputs.size(); ++i) outputs.set(i, 200 + Id(in));
}

void FillInstanceFinished(FuzzedDataProvider& in, proto::InstanceFinished::Builder finished) {
  finished.setGraphId(GraphId(in));
  finished.setInstance(Id(in));
  if (in.ConsumeIntegralInRange(0, 3) == 0) FillError(in, finished.initError());
  auto outputs = finished.initOutputs(in.ConsumeIntegralInRange<unsigned>(0, 3));
  for (unsigned i = 0; i < outputs.size(); ++i) {
    outputs[i].setId(in.ConsumeBool() ? 100 + Id(in) : 200 + Id(in));
    outputs[i].setBytes(in.ConsumeBool() ? 4 : Int(in));
    outputs[i].setInline(Bytes(Text(in, 8)));
  }
  // Put back after a failure: objects it may or may not have been told to take over.
  auto restored = finished.initRestored(in.ConsumeIntegralInRange<unsigned>(0, 2));
  for (unsigned i = 0; i < restored.size(); ++i) restored.set(i, Id(in));
  if (in.ConsumeBool()) {
    auto report = finished.initReport();
    report.setGraphId(finished.getGraphId());
    auto peaks = report.initRolePeaks(in.ConsumeIntegralInRange<unsigned>(0, 14));
    for (unsigned i = 0; i < peaks.size(); ++i) peaks.set(i, Int(in));
    report.setWallMicros(Int(in));
    report.setPushedBytes(Int(in));
    report.setCollectiveBytesSent(Int(in));
  }
  if (in.ConsumeBool()) {
    if (in.ConsumeBool()) {
      // Raw bytes: the unpacker's own checks.
      const std::string packed = in.ConsumeRandomLengthString(64);
      finished.initSpans().setPacked(
          capnp::Data::Reader(reinterpret_cast<const kj::byte*>(packed.data()), packed.size()));
    } else {
      WorkerSpans spans;
      const unsigned tasks = in.ConsumeIntegralInRange<unsigned>(0, 3);
      for (unsigned i = 0; i < tasks; ++i) {
        spans.tasks.push_back(WorkerSpans::Task{in.ConsumeIntegralInRange<uint64_t>(0, 5),
                                                in.ConsumeIntegralInRange<int>(-3, 3), Int(in),
                                                Int(in), Int(in)});
      }
      const unsigned pushes = in.ConsumeIntegralInRange<unsigned>(0, 2);
      for (unsigned i = 0; i < pushes; ++i) {
        spans.pushes.push_back(WorkerSpans::Push{in.ConsumeIntegralInRange<uint64_t>(0, 5), Id(in),
                                                 Int(in), Int(in), Int(in)});
      }
      rpc::ToWire(spans, finished.initSpans());
    }
  }
}

void FillHeartbeat(FuzzedDataProvider& in, proto::Heartbeat::Builder heartbeat) {
  heartbeat.setHostUsed(Int(in));
  heartbeat.setHostCapacity(Int(in));
  heartbeat.setTasksDone(Int(in));
  auto waits = heartbeat.initWaits();
  auto running = waits.initRunning(in.ConsumeIntegralInRange<unsigned>(0, 2));
  for (unsigned i = 0; i < running.size(); ++i) running.set(i, Text(in));
  auto awaited = waits.initAwaited(in.ConsumeIntegralInRange<unsigned>(0, 2));
  for (unsigned i = 0; i < awaited.size(); ++i) {
    awaited[i].setName(Text(in));
    awaited[i].setProducer(Id(in));
  }
  if (in.ConsumeBool()) {
    auto collective = waits.initCollective();
    collective.setTask(Text(in));
    collective.setGroup(Id(in));
    collective.setRank(in.ConsumeIntegral<int32_t>());
    collective.setSize(in.ConsumeIntegral<int32_t>());
    collective.setForming(in.ConsumeBool());
  }
}

// The body of one message of kind `kind` (an index into the kinds below).
void FillBody(FuzzedDataProvider& in, int kind, Body::Builder body) {
  switch (kind) {
    case 0: {
      auto tasks = body.initSubmitTasks().initTasks(in.ConsumeIntegralInRange<unsigned>(0, 3));
      for (unsigned i = 0; i < tasks.size(); ++i) FillTask(in, tasks[i], 10 + Id(in));
      break;
    }
    case 1: {
      auto put = body.initPutObjects();
      auto objects = put.initObjects(in.ConsumeIntegralInRange<unsigned>(0, 2));
      for (unsigned i = 0; i < objects.size(); ++i) FillDecl(in, objects[i], 30 + Id(in));
      auto inlines = put.initInline(in.ConsumeIntegralInRange<unsigned>(0, 2));
      for (unsigned i = 0; i < inlines.size(); ++i) inlines.set(i, Bytes(Text(in, 8)));
      break;
    }
    case 2:
    case 3: {
      auto ids = kind == 2 ? body.initReleaseObjects().initIds(in.ConsumeIntegralInRange(0, 3))
                           : body.initWatchObjects().initIds(in.ConsumeIntegralInRange(0, 3));
      for (unsigned i = 0; i < ids.size(); ++i)
        ids.set(i, in.ConsumeBool() ? Id(in) : 100 + Id(in));
      break;
    }
    case 4:
      FillRegisterGraph(in, body.initRegisterGraph());
      break;
    case 5:
      FillRunGraph(in, body.initRunGraph());
      break;
    case 6:
      FillInstanceFinished(in, body.initInstanceFinished());
      break;
    case 7: {
      auto join = body.initCollectiveJoin();
      join.setGroup(Id(in));
      join.setEpoch(in.ConsumeIntegralInRange<uint32_t>(0, 3));
      join.setRound(in.ConsumeIntegralInRange<uint32_t>(0, 3));
      join.setRank(in.ConsumeBool() ? in.ConsumeIntegralInRange(0, 2) : in.ConsumeIntegral<int>());
      join.setSize(in.ConsumeBool() ? in.ConsumeIntegralInRange(1, 3) : in.ConsumeIntegral<int>());
      join.setBlob(Bytes(Text(in, 8)));
      break;
    }
    case 8: {
      auto failed = body.initCollectiveFailed();
      failed.setGroup(Id(in));
      FillError(in, failed.initError());
      failed.setSilentMs(Int(in));
      failed.setSilentPeer(in.ConsumeIntegral<int32_t>());
      failed.setEpoch(in.ConsumeIntegralInRange<uint32_t>(0, 3));
      break;
    }
    case 9:
      FillHeartbeat(in, body.initHeartbeat());
      break;
    case 10: {
      auto request = body.initTimelineRequest();
      request.setLastInstances(in.ConsumeIntegral<int32_t>());
      request.setGraphId(GraphId(in));
      break;
    }
    case 11: {
      auto progress = body.initJobProgress();
      progress.setJob(Text(in));
      progress.setStep(Int(in));
      progress.setLoss(in.ConsumeFloatingPoint<double>());
      progress.setStepMs(in.ConsumeFloatingPoint<double>());
      break;
    }
    case 12:
      body.initStatusRequest();
      break;
    case 13: {
      auto hello = body.initHello();
      hello.setProtocolVersion(in.ConsumeBool() ? rpc::kProtocolVersion : 1);
      hello.setRole(static_cast<proto::Role>(in.ConsumeIntegralInRange(0, 3)));
      hello.setToken(in.ConsumeBool() ? "secret" : Text(in));
      hello.setHostname(Text(in));
      hello.setDataAddress(Text(in));
      hello.setHostCapacity(Int(in));
      hello.setGpu(in.ConsumeBool() ? "" : "gpu");
      break;
    }
    case 14: {  // a plugin's library: its digest right or wrong, the store's bounds, the setting
      auto plugin = body.initLoadPlugin();
      const std::string library = in.ConsumeBool() ? std::string(kPluginLibrary) : Text(in, 64);
      plugin.setName(Text(in));
      plugin.setSha256(in.ConsumeBool() ? Sha256Hex(library) : Text(in));
      plugin.setLibrary(Bytes(library));
      break;
    }
    default:  // a kind the scheduler never accepts
      FillError(in, body.initReply());
      break;
  }
}

constexpr int kKinds = 16;

// One cluster per input: two workers, a driver holding object 1, a clock the script advances.
class Harness {
 public:
  Harness()
      : core_(SchedulerOptions{.token = "secret", .session_dir = "/tmp/fuzz"}, &outbox_,
              [this] { return now_; }) {
    workers_[0] = Join(proto::Role::WORKER, "");
    workers_[1] = Join(proto::Role::WORKER, "gpu");
    drivers_[0] = Join(proto::Role::DRIVER, "");
    drivers_[1] = Join(proto::Role::DRIVER, "");
    capnp::MallocMessageBuilder message;
    auto put = message.initRoot<proto::Envelope>().initBody().initPutObjects();
    rpc::ToWire(
        ObjectSpec{
            ObjectId(1), "x", {Shape{1}, DType::kF32, Device::Cpu()}, ObjectRole::kInput, TaskId()},
        put.initObjects(1)[0]);
    put.initInline(1).set(0, Bytes("abcd"));
    Deliver(drivers_[0], rpc::EncodeFrame(message));
  }

  // Frames in `bytes` from `from`, as the service hands them over.
  void Deliver(WorkerId from, const std::vector<uint8_t>& bytes) {
    rpc::FrameDecoder decoder;
    if (!decoder.Feed(bytes).ok()) return;  // the connection would close
    while (decoder.HasMessage()) {
      std::unique_ptr<rpc::ReceivedMessage> message = decoder.PopMessage();
      const Status handled = rpc::CatchMalformed(
          [&] { return core_.Handle(from, message->reader().getRoot<proto::Envelope>()); });
      core_.Flush();
      if (!handled.ok()) {
        core_.Disconnected(from, handled);
        return;
      }
    }
  }

  void Step(FuzzedDataProvider& in) {
    const int sender = in.ConsumeIntegralInRange(0, 5);
    const int kind = in.ConsumeIntegralInRange(0, kKinds + 1);
    if (kind == kKinds) {  // time passes: heartbeats and collective verdicts fall due
      now_ += std::chrono::milliseconds(in.ConsumeIntegralInRange(0, 5000));
      core_.Tick();
      core_.Flush();
      return;
    }
    if (kind == kKinds + 1) {
      core_.Disconnected(Sender(sender), Unavailable("the connection dropped"));
      core_.Flush();
      return;
    }
    capnp::MallocMessageBuilder message;
    auto envelope = message.initRoot<proto::Envelope>();
    envelope.setRequestId(in.ConsumeIntegralInRange<uint64_t>(0, 3));
    FillBody(in, kind, envelope.initBody());
    Deliver(Sender(sender), rpc::EncodeFrame(message));
  }

  WorkerId Sender(int pick) {
    switch (pick) {
      case 0:
      case 1:
        return workers_[pick];
      case 2:
      case 3:
        return drivers_[pick - 2];
      default:
        return core_.Accept();  // a new connection: it must say Hello first
    }
  }

 private:
  WorkerId Join(proto::Role role, const std::string& gpu) {
    const WorkerId id = core_.Accept();
    capnp::MallocMessageBuilder message;
    auto hello = message.initRoot<proto::Envelope>().initBody().initHello();
    hello.setProtocolVersion(rpc::kProtocolVersion);
    hello.setRole(role);
    hello.setToken("secret");
    hello.setHostname("host");
    hello.setDataAddress("data-" + std::to_string(id.value()));
    hello.setHostCapacity(int64_t{1} << 30);
    hello.setGpu(gpu);
    Deliver(id, rpc::EncodeFrame(message));
    return id;
  }

  NullOutbox outbox_;
  SchedulerCore::Clock::time_point now_{};
  SchedulerCore core_;
  std::array<WorkerId, 2> workers_;
  std::array<WorkerId, 2> drivers_;
};

// ---- Seeds ----

std::vector<uint8_t> Frame(const std::function<void(proto::Envelope::Builder)>& fill) {
  capnp::MallocMessageBuilder message;
  fill(message.initRoot<proto::Envelope>());
  return rpc::EncodeFrame(message);
}

Seed RawSeed(uint8_t sender, const std::vector<uint8_t>& frames) {
  Seed seed = {0, sender};
  seed.insert(seed.end(), frames.begin(), frames.end());
  return seed;
}

TaskSpec Gelu(uint64_t id, Attrs attrs = {}) {
  TaskSpec spec;
  spec.id = TaskId(id);
  spec.name = "t" + std::to_string(id);
  spec.op = attrs.Has(kCollectiveAttr) ? "all_reduce" : "gelu_forward";
  spec.inputs = {ObjectId(1)};
  spec.outputs = {ObjectId(100 + id)};
  spec.attrs = std::move(attrs);
  return spec;
}

ObjectSpec OutputOf(const TaskSpec& task) {
  return ObjectSpec{task.outputs[0],
                    "o",
                    {Shape{1}, DType::kF32, Device::Cpu()},
                    ObjectRole::kActivation,
                    task.id};
}

std::vector<uint8_t> SubmitFrame(const std::vector<TaskSpec>& tasks) {
  return Frame([&](proto::Envelope::Builder e) {
    auto wire = e.initBody().initSubmitTasks().initTasks(static_cast<unsigned>(tasks.size()));
    for (unsigned i = 0; i < tasks.size(); ++i)
      rpc::ToWire(tasks[i], {OutputOf(tasks[i])}, wire[i]);
  });
}

Attrs Member(int64_t rank, int64_t size) {
  return Attrs{{kCollectiveAttr, int64_t{1}}, {kRankAttr, rank}, {kGroupSizeAttr, size}};
}

std::vector<Seed> Seeds() {
  std::vector<Seed> seeds;
  constexpr uint8_t kDriver = 2;
  constexpr uint8_t kWorker = 0;
  seeds.push_back(RawSeed(kDriver, SubmitFrame({Gelu(10)})));
  seeds.push_back(RawSeed(kDriver, SubmitFrame({Gelu(10, Member(0, 2)), Gelu(11, Member(1, 2))})));
  // The two reported attacks.
  seeds.push_back(RawSeed(kDriver, SubmitFrame({Gelu(10, Member(0, 2'000'000'000))})));
  seeds.push_back(RawSeed(kDriver, SubmitFrame({Gelu(10, Member(2147483000, 4294967298))})));
  seeds.push_back(RawSeed(kDriver, Frame([](proto::Envelope::Builder e) {
                            e.setRequestId(3);
                            auto graph = e.initBody().initRegisterGraph();
                            graph.setGraphId(1);
                            auto objects = graph.initObjects(2);
                            rpc::ToWire(ObjectSpec{ObjectId(1),
                                                   "x",
                                                   {Shape{1}, DType::kF32, Device::Cpu()},
                                                   ObjectRole::kInput,
                                                   TaskId()},
                                        objects[0]);
                            TaskSpec task = Gelu(1);
                            task.outputs = {ObjectId(2)};
                            ObjectSpec out = OutputOf(task);
                            rpc::ToWire(out, objects[1]);
                            rpc::ToWire(task, {out}, graph.initTasks(1)[0]);
                            graph.initOutputs(1).set(0, 2);
                          })));
  seeds.push_back(RawSeed(kDriver, Frame([](proto::Envelope::Builder e) {
                            auto run = e.initBody().initRunGraph();
                            run.setGraphId(1);
                            run.setInstance(1);
                            auto input = run.initInputs(1)[0];
                            input.setObject(1);
                            input.initSource().setObject(1);
                            run.initOutputIds(1).set(0, 200);
                          })));
  seeds.push_back(RawSeed(kDriver, Frame([](proto::Envelope::Builder e) {
                            e.initBody().initWatchObjects().initIds(2).set(0, 1);
                          })));
  seeds.push_back(RawSeed(kWorker, Frame([](proto::Envelope::Builder e) {
                            auto finished = e.initBody().initInstanceFinished();
                            finished.setGraphId(kFirstSchedulerGraphId);
                            finished.setInstance(10);
                            auto output = finished.initOutputs(1)[0];
                            output.setId(110);
                            output.setBytes(4);
                            WorkerSpans spans;
                            spans.tasks.push_back(WorkerSpans::Task{1, 0, 0, 5, 0});
                            rpc::ToWire(spans, finished.initSpans());
                          })));
  seeds.push_back(RawSeed(kWorker, Frame([](proto::Envelope::Builder e) {
                            e.initBody().initHeartbeat().setTasksDone(3);
                          })));
  seeds.push_back(RawSeed(kWorker, Frame([](proto::Envelope::Builder e) {
                            auto join = e.initBody().initCollectiveJoin();
                            join.setGroup(1);
                            join.setSize(2);
                          })));
  // Structured scripts: one per kind, then a few mixed ones, from a fixed generator.
  uint64_t state = 0x9e3779b97f4a7c15u;
  auto next = [&state] {
    state = state * 6364136223846793005u + 1442695040888963407u;
    return static_cast<uint8_t>(state >> 56);
  };
  for (int kind = 0; kind < kKinds + 6; ++kind) {
    Seed seed = {1};
    for (int i = 0; i < 96; ++i) seed.push_back(next());
    // FuzzedDataProvider takes integers from the end: the last bytes pick sender and kind.
    seed.push_back(static_cast<uint8_t>(kind % (kKinds + 2)));
    seed.push_back(static_cast<uint8_t>(kind < 9 && kind != 1 && kind != 2 && kind != 3 ? 2 : 0));
    seeds.push_back(std::move(seed));
  }
  return seeds;
}

}  // namespace
}  // namespace tessera::fuzz

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  tessera::fuzz::InitializeTarget(tessera::fuzz::Seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using tessera::fuzz::Harness;
  if (size < 2) return 0;
  Harness harness;
  if (data[0] % 2 == 0) {  // raw frames
    harness.Deliver(harness.Sender(data[1] % 4), std::vector<uint8_t>(data + 2, data + size));
    return 0;
  }
  FuzzedDataProvider in(data + 1, size - 1);
  for (int step = 0; step < 24 && in.remaining_bytes() > 0; ++step) harness.Step(in);
  return 0;
}
