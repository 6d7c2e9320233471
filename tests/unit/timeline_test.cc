// Traces of steps: the task classification, the wire form of spans, the scheduler's store of
// the latest instances, the Chrome/Perfetto writer's schema, and the in-process backend's
// timeline of a real GPT-2 step.
#include <capnp/message.h>

#include <set>
#include <tuple>

#include <gtest/gtest.h>

#include "client/trace.h"
#include "core/rpc/wire.h"
#include "core/timeline.h"
#include "gpt2_test_util.h"
#include "scheduler/trace_store.h"
#include "test_util.h"
#include "trace_schema.h"
#include "training/token_dataset.h"
#include "training/trainer.h"

namespace tessera::testing {
namespace {

TEST(ClassifyTaskTest, KindsOfTrainingTasks) {
  const struct {
    const char* name;
    const char* op;
    SpanKind kind;
  } cases[] = {
      {"rank0/h.0/forward", "transformer_block_forward", SpanKind::kForward},
      {"embedding/forward", "embedding_forward", SpanKind::kForward},
      {"loss", "softmax_cross_entropy", SpanKind::kForward},
      {"h.0/backward", "transformer_block_backward", SpanKind::kBackward},
      {"loss/grad", "loss_gradient", SpanKind::kBackward},
      {"h.0.fc/sum1", "accumulate", SpanKind::kBackward},
      {"h.3/backward_input", "transformer_block_backward", SpanKind::kBackwardInput},
      {"h.3/backward_weight", "transformer_block_backward", SpanKind::kBackwardWeight},
      {"rank1/h.3/backward_input@2", "transformer_block_backward_input", SpanKind::kBackwardInput},
      {"h.3/backward_weight@11", "layer_backward_weight", SpanKind::kBackwardWeight},
      {"h.3/backward@2", "transformer_block_backward", SpanKind::kBackward},
      {"rank1/h.0/adamw", "adamw", SpanKind::kOptimizer},
      {"h.0/sgd", "sgd", SpanKind::kOptimizer},
      {"rank0/clip", "clip_scale", SpanKind::kOptimizer},
      {"clip_off", "constant", SpanKind::kOptimizer},
      {"rank0/h.1/grad_norm", "sum_of_squares", SpanKind::kOptimizer},
      {"rank0/grad_norm/sum", "sum_scalars", SpanKind::kOptimizer},
      {"rank0/h.0/gather_forward", "all_gather", SpanKind::kCollective},
      {"h.0/gather", "all_gather_in_place", SpanKind::kCollective},
      {"h.0/reduce_scatter", "reduce_scatter", SpanKind::kCollective},
      {"grad_norm/all_reduce", "all_reduce", SpanKind::kCollective},
      {"params/broadcast", "broadcast", SpanKind::kCollective},
      {"h.0/attn/heads_to_sequence", "all_to_all", SpanKind::kCollective},
      {"h.0/grad_to_host", "copy", SpanKind::kTransfer},
      {"clip_to_host", "copy", SpanKind::kTransfer},
      {"save/h.0.w", "write_file", SpanKind::kTransfer},
      {"rank0/loss/sum", "sum_scalars", SpanKind::kOther},
      {"wait", "sleep", SpanKind::kOther},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(SpanKindName(ClassifyTask(c.name, c.op)), SpanKindName(c.kind))
        << c.name << " (" << c.op << ")";
  }
}

TEST(ClassifyTaskTest, KindAndStreamNames) {
  std::set<std::string_view> names;
  for (int k = 0; k < kSpanKinds; ++k) names.insert(SpanKindName(static_cast<SpanKind>(k)));
  EXPECT_EQ(names.size(), static_cast<size_t>(kSpanKinds));
  EXPECT_EQ(StreamName(3), "compute 3");
  EXPECT_EQ(StreamName(kTransferStream), "transfer");
  EXPECT_EQ(StreamName(kCollectiveStream), "collective");
}

TEST(TimelineWireTest, WorkerSpansRoundTrip) {
  WorkerSpans spans;
  spans.tasks.push_back({3, 1, 1000, 1500, 0});
  spans.tasks.push_back({4, kCollectiveStream, 1200, 1300, 4096});
  spans.pushes.push_back({7, 2, 1500, 1600, 8192});
  capnp::MallocMessageBuilder message;
  rpc::ToWire(spans, message.initRoot<proto::InstanceSpans>());
  ASSERT_OK_AND_ASSIGN(WorkerSpans back, rpc::FromWire(message.getRoot<proto::InstanceSpans>()));
  ASSERT_EQ(back.tasks.size(), 2u);
  EXPECT_EQ(back.tasks[1].task, 4u);
  EXPECT_EQ(back.tasks[1].stream, kCollectiveStream);
  EXPECT_EQ(back.tasks[1].bytes, 4096);
  ASSERT_EQ(back.pushes.size(), 1u);
  EXPECT_EQ(back.pushes[0].destination, 2u);
  EXPECT_EQ(back.pushes[0].end_us, 1600);
}

TEST(TimelineWireTest, RefusesForgedSpans) {
  capnp::MallocMessageBuilder message;
  WorkerSpans forged;  // PackSpans does not check: a forger's packing
  forged.tasks.push_back({3, 0, 10, 5, 0});
  rpc::ToWire(forged, message.initRoot<proto::InstanceSpans>());
  Result<WorkerSpans> backwards = rpc::FromWire(message.getRoot<proto::InstanceSpans>());
  EXPECT_EQ(backwards.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(backwards.status().message().find("before it starts"), std::string::npos);

  capnp::MallocMessageBuilder reply;
  auto spans = reply.initRoot<proto::Timeline>().initSpans(1);
  spans[0].setKind(kSpanKinds);
  Result<Timeline> kind = rpc::FromWire(reply.getRoot<proto::Timeline>());
  EXPECT_EQ(kind.status().code(), StatusCode::kInvalidArgument);
  spans[0].setKind(0);
  spans[0].setStream(-7);
  EXPECT_EQ(rpc::FromWire(reply.getRoot<proto::Timeline>()).status().code(),
            StatusCode::kInvalidArgument);
}

// Packed spans: every id, stream and size a record can hold, and every time in
// [0, kMaxSpanMicros], comes back, in any order; typical spans (ids and starts rising, short
// tasks) take a few bytes each.
TEST(PackedSpansTest, RoundTripsEveryValue) {
  WorkerSpans spans;
  spans.tasks.push_back({1, 0, 1'700'000'000'000'000, 1'700'000'000'000'010, 0});
  spans.tasks.push_back({UINT64_MAX, INT16_MAX, 0, 1, INT64_MAX});
  spans.tasks.push_back({2, kCollectiveStream, 0, kMaxSpanMicros, 1});
  spans.tasks.push_back({0, 1, kMaxSpanMicros, kMaxSpanMicros, 0});
  spans.pushes.push_back({9, UINT64_MAX, 5, 7, 123});
  spans.pushes.push_back({1, 0, 100, 100, 0});
  ASSERT_OK_AND_ASSIGN(WorkerSpans back, UnpackSpans(PackSpans(spans)));
  ASSERT_EQ(back.tasks.size(), spans.tasks.size());
  for (size_t i = 0; i < spans.tasks.size(); ++i) {
    const WorkerSpans::Task& a = spans.tasks[i];
    const WorkerSpans::Task& b = back.tasks[i];
    EXPECT_EQ(std::tie(a.task, a.stream, a.start_us, a.end_us, a.bytes),
              std::tie(b.task, b.stream, b.start_us, b.end_us, b.bytes))
        << "task " << i;
  }
  ASSERT_EQ(back.pushes.size(), spans.pushes.size());
  for (size_t i = 0; i < spans.pushes.size(); ++i) {
    const WorkerSpans::Push& a = spans.pushes[i];
    const WorkerSpans::Push& b = back.pushes[i];
    EXPECT_EQ(std::tie(a.object, a.destination, a.start_us, a.end_us, a.bytes),
              std::tie(b.object, b.destination, b.start_us, b.end_us, b.bytes))
        << "push " << i;
  }

  WorkerSpans step;  // 10,000 tasks of 3 us, one after another on 2 slots
  for (uint64_t t = 1; t <= 10'000; ++t) {
    const int64_t start = 1'700'000'000'000'000 + static_cast<int64_t>(t) * 2;
    step.tasks.push_back({t, static_cast<int>(t % 2), start, start + 3, 0});
  }
  const std::string packed = PackSpans(step);
  EXPECT_LE(packed.size(), 6 * step.tasks.size() + 16);
  ASSERT_OK_AND_ASSIGN(WorkerSpans step_back, UnpackSpans(packed));
  EXPECT_EQ(step_back.tasks.back().end_us, step.tasks.back().end_us);
  EXPECT_OK(CheckPackedSpans(packed));
}

// A packing cut short anywhere, lengthened, or holding an impossible span is refused with a
// reason; none is read past its end.
TEST(PackedSpansTest, RefusesDamagedPackings) {
  WorkerSpans spans;
  spans.tasks.push_back({3, 1, 1000, 1500, 0});
  spans.tasks.push_back({4, kCollectiveStream, 1200, 1300, 4096});
  spans.pushes.push_back({7, 2, 1500, 1600, 8192});
  const std::string packed = PackSpans(spans);
  for (size_t length = 0; length < packed.size(); ++length) {
    const std::string cut = packed.substr(0, length);
    EXPECT_EQ(UnpackSpans(cut).status().code(), StatusCode::kInvalidArgument) << length;
    EXPECT_EQ(CheckPackedSpans(cut).code(), StatusCode::kInvalidArgument) << length;
  }
  EXPECT_NE(UnpackSpans(packed + "x").status().message().find("after the last record"),
            std::string::npos);
  // Counts no packing of this size could hold: refused before anything is reserved.
  const std::string huge_counts("\xff\xff\xff\xff\x0f\x00", 6);
  EXPECT_NE(UnpackSpans(huge_counts).status().message().find("count"), std::string::npos);
  // A varint of more than 64 bits.
  EXPECT_NE(UnpackSpans(std::string(11, '\xff')).status().message().find("over 64 bits"),
            std::string::npos);

  auto refused = [](const WorkerSpans& forged, const std::string& reason) {
    const Status status = UnpackSpans(PackSpans(forged)).status();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << reason;
    EXPECT_NE(status.message().find(reason), std::string::npos) << status.ToString();
  };
  WorkerSpans stream;
  stream.tasks.push_back({1, -7, 0, 1, 0});
  refused(stream, "stream -7");
  WorkerSpans bytes;
  bytes.tasks.push_back({1, 0, 0, 1, -1});
  refused(bytes, "bytes");
  WorkerSpans backwards;
  backwards.pushes.push_back({1, 2, 10, 5, 0});
  refused(backwards, "ends before it starts");
  WorkerSpans overflow;
  overflow.tasks.push_back({1, 0, 0, 1, 0});
  overflow.tasks.push_back({2, 0, INT64_MAX, INT64_MIN + 5, 0});  // wraps past the end of time
  refused(overflow, "ends before it starts");
  // Times whose differences could overflow a reader's arithmetic (a trace's origin).
  WorkerSpans before_epoch;
  before_epoch.tasks.push_back({1, 0, -5, 20, 0});
  refused(before_epoch, "span [-5, 20] us is outside [0, 1152921504606846976]");
  WorkerSpans past_bound;
  past_bound.pushes.push_back({1, 2, 0, kMaxSpanMicros + 1, 0});
  refused(past_bound, "is outside [0,");
}

// The overlap figure: each selected span's time under its own worker's compute (overlapping
// compute spans counted once, other workers' compute and transfers not at all).
TEST(OverlapTest, HiddenUnderComputeCountsEachWorkersOwnComputeOnce) {
  Timeline timeline;
  auto add = [&](uint64_t worker, int stream, SpanKind kind, int64_t start, int64_t end,
                 std::string name) {
    TimelineSpan span;
    span.worker = WorkerId(worker);
    span.stream = stream;
    span.kind = kind;
    span.start_us = start;
    span.end_us = end;
    span.name = std::move(name);
    timeline.spans.push_back(span);
  };
  add(1, 0, SpanKind::kBackward, 100, 200, "b0");
  add(1, 1, SpanKind::kBackward, 150, 260, "b1");  // overlaps b0: [100, 260] once
  add(1, 0, SpanKind::kOptimizer, 400, 450, "adam");
  add(1, kTransferStream, SpanKind::kTransfer, 0, 1000, "push");                 // not compute
  add(2, 0, SpanKind::kForward, 0, 1000, "f");                                   // another worker's
  add(1, kCollectiveStream, SpanKind::kCollective, 50, 300, "gather_backward");  // 160 of 250
  add(1, kCollectiveStream, SpanKind::kCollective, 420, 520, "reduce");          // 30 of 100
  add(2, kCollectiveStream, SpanKind::kCollective, 1000, 1100, "gather_late");   // 0 of 100
  const auto named = [](const std::string& part) {
    return [part](const TimelineSpan& span) { return span.name.find(part) != std::string::npos; };
  };
  const OverlapFigures gathers = HiddenUnderCompute(timeline, named("gather"));
  EXPECT_EQ(gathers.spans, 2);
  EXPECT_EQ(gathers.total_us, 350);
  EXPECT_EQ(gathers.hidden_us, 160);
  const OverlapFigures reduce = HiddenUnderCompute(timeline, named("reduce"));
  EXPECT_EQ(reduce.hidden_us, 30);
  EXPECT_DOUBLE_EQ(reduce.hidden(), 0.3);
  const OverlapFigures none = HiddenUnderCompute(timeline, named("nothing"));
  EXPECT_EQ(none.spans, 0);
  EXPECT_EQ(none.hidden(), 0.0);
}

// A step's tasks span from the first start to the last end on any worker, collectives included,
// pushes between workers (which may start before and end after them) not.
TEST(TaskSpanTest, FromTheFirstTasksStartToTheLastsEndPushesAside) {
  Timeline timeline;
  EXPECT_EQ(TaskSpanMs(timeline), 0.0);
  const auto add = [&](uint64_t worker, int stream, int64_t start, int64_t end) {
    TimelineSpan span;
    span.worker = WorkerId(worker);
    span.stream = stream;
    span.start_us = start;
    span.end_us = end;
    timeline.spans.push_back(span);
  };
  add(1, kTransferStream, 0, 100);
  EXPECT_EQ(TaskSpanMs(timeline), 0.0);
  add(1, 0, 1000, 1500);
  add(2, 0, 1200, 2000);
  add(2, kCollectiveStream, 1900, 2750);
  add(2, kTransferStream, 2000, 9000);
  EXPECT_DOUBLE_EQ(TaskSpanMs(timeline), 1.75);
}

TEST(TimelineWireTest, TimelineRoundTrip) {
  Timeline timeline;
  timeline.processes.push_back({WorkerId(2), "host-a", 1234});
  TimelineSpan span;
  span.worker = WorkerId(2);
  span.stream = kCollectiveStream;
  span.name = "h.0/gather_forward";
  span.layer = "h.0";
  span.op = "all_gather";
  span.kind = SpanKind::kCollective;
  span.start_us = 10;
  span.end_us = 20;
  span.bytes = 64;
  span.graph = 5;
  span.instance = 6;
  timeline.spans.push_back(span);
  capnp::MallocMessageBuilder message;
  rpc::ToWire(timeline, message.initRoot<proto::Timeline>());
  ASSERT_OK_AND_ASSIGN(Timeline back, rpc::FromWire(message.getRoot<proto::Timeline>()));
  ASSERT_EQ(back.processes.size(), 1u);
  EXPECT_EQ(back.processes[0].hostname, "host-a");
  EXPECT_EQ(back.processes[0].pid, 1234);
  ASSERT_EQ(back.spans.size(), 1u);
  EXPECT_EQ(back.spans[0].name, span.name);
  EXPECT_EQ(back.spans[0].kind, SpanKind::kCollective);
  EXPECT_EQ(back.spans[0].stream, kCollectiveStream);
  EXPECT_EQ(back.spans[0].instance, 6u);
}

// A two-task graph: a forward and an all_gather, graph-local ids 1 and 2.
struct SmallGraph {
  std::vector<TaskSpec> tasks;
  std::vector<ObjectSpec> objects;
  SmallGraph() {
    TaskSpec forward;
    forward.id = TaskId(1);
    forward.name = "h.0/forward";
    forward.layer = "h.0";
    forward.op = "transformer_block_forward";
    TaskSpec gather;
    gather.id = TaskId(2);
    gather.name = "h.1/gather_forward";
    gather.layer = "h.1";
    gather.op = "all_gather";
    tasks = {forward, gather};
    ObjectSpec x;
    x.id = ObjectId(1);
    x.name = "h.0.out";
    objects = {x};
  }
};

WorkerSpans Spans(int64_t at) {
  WorkerSpans spans;
  spans.tasks.push_back({1, 0, at, at + 10, 0});
  spans.tasks.push_back({2, kCollectiveStream, at + 2, at + 8, 512});
  spans.pushes.push_back({1, 4, at + 10, at + 12, 256});
  return spans;
}

TEST(TraceStoreTest, KeepsTheLatestInstancesWithNames) {
  SmallGraph graph;
  TraceStore store(3);
  for (uint64_t instance = 1; instance <= 5; ++instance) {
    for (uint64_t worker : {1, 2}) {
      store.Record(WorkerId(worker), 7, instance, Spans(static_cast<int64_t>(instance) * 100),
                   &graph.tasks, &graph.objects);
    }
  }
  EXPECT_EQ(store.instances(), 3u);  // bounded
  std::vector<TimelineSpan> all = store.Collect(0, 0, nullptr);
  ASSERT_EQ(all.size(), 3u * 2u * 3u);
  EXPECT_EQ(all.front().instance, 3u);  // oldest kept first
  EXPECT_EQ(all.back().instance, 5u);
  std::vector<TimelineSpan> last = store.Collect(1, 7, nullptr);
  ASSERT_EQ(last.size(), 6u);
  for (const TimelineSpan& span : last) EXPECT_EQ(span.instance, 5u);
  EXPECT_EQ(last[0].name, "h.0/forward");
  EXPECT_EQ(last[0].layer, "h.0");
  EXPECT_EQ(last[0].kind, SpanKind::kForward);
  EXPECT_EQ(last[1].kind, SpanKind::kCollective);
  EXPECT_EQ(last[1].stream, kCollectiveStream);
  EXPECT_EQ(last[1].bytes, 512);
  EXPECT_EQ(last[2].kind, SpanKind::kTransfer);
  EXPECT_EQ(last[2].stream, kTransferStream);
  EXPECT_NE(last[2].name.find("h.0.out"), std::string::npos);
  EXPECT_NE(last[2].name.find("worker4"), std::string::npos);
  EXPECT_TRUE(store.Collect(5, 8, nullptr).empty());  // another graph
}

TEST(TraceStoreTest, LeavesOutRunningInstancesAndNamesUnknownGraphsById) {
  TraceStore store(4);
  store.Record(WorkerId(1), 9, 1, Spans(0), nullptr, nullptr);
  store.Record(WorkerId(1), 9, 2, Spans(100), nullptr, nullptr);
  auto running = [](uint64_t, uint64_t instance) { return instance == 2; };
  std::vector<TimelineSpan> spans = store.Collect(1, 9, running);
  ASSERT_FALSE(spans.empty());
  for (const TimelineSpan& span : spans) EXPECT_EQ(span.instance, 1u);
  EXPECT_EQ(spans[0].name, "task 1");
  EXPECT_EQ(spans[0].kind, SpanKind::kOther);
}

TEST(ChromeTraceTest, SchemaOfASyntheticTimeline) {
  Timeline timeline;
  timeline.processes.push_back({WorkerId(2), "host", 77});
  for (int stream : {0, 1, kCollectiveStream, kTransferStream}) {
    TimelineSpan span;
    span.worker = WorkerId(2);
    span.stream = stream;
    span.name = "a \"quoted\"\\name\n";
    span.kind = stream == kCollectiveStream ? SpanKind::kCollective : SpanKind::kForward;
    span.start_us = 1'700'000'000'000'000 + stream;
    span.end_us = span.start_us + (stream == 0 ? 0 : 25);
    span.bytes = 3;
    span.instance = 11;
    timeline.spans.push_back(span);
  }
  TimelineSpan unnamed;  // a process not listed, a span without a name
  unnamed.worker = WorkerId(5);
  unnamed.op = "noop";
  unnamed.start_us = unnamed.end_us = 1'700'000'000'000'100;
  timeline.spans.push_back(unnamed);
  nlohmann::json trace = ExpectChromeTraceSchema(ChromeTraceJson(timeline));
  ASSERT_FALSE(trace.is_null());
  std::set<std::string> process_names, thread_names;
  int complete = 0;
  for (const nlohmann::json& event : trace["traceEvents"]) {
    if (event["ph"] == "M" && event["name"] == "process_name") {
      process_names.insert(event["args"]["name"].get<std::string>());
    } else if (event["ph"] == "M") {
      thread_names.insert(event["args"]["name"].get<std::string>());
    } else {
      ++complete;
      EXPECT_GE(event["ts"].get<double>(), 0);  // from the earliest span
    }
  }
  EXPECT_EQ(complete, 5);
  EXPECT_TRUE(process_names.contains("worker 2 (host:77)"));
  EXPECT_TRUE(process_names.contains("worker 5"));
  EXPECT_TRUE(thread_names.contains("compute 1"));
  EXPECT_TRUE(thread_names.contains("collective"));
  EXPECT_TRUE(thread_names.contains("transfer"));
  EXPECT_EQ(trace["traceEvents"].back()["name"], "noop");
}

TEST(ChromeTraceTest, WriteNamesThePathItCouldNotWrite) {
  Status written = WriteChromeTrace("/nonexistent-dir/trace.json", Timeline{});
  EXPECT_FALSE(written.ok());
  EXPECT_NE(written.message().find("/nonexistent-dir/trace.json"), std::string::npos);
}

TEST(InProcessTimelineTest, StepsOfGpt2TinyHaveEveryKind) {
  TrainingPlan plan;
  plan.batch = 4;
  plan.seq_len = 32;
  ExecutorOptions options;
  options.threads = 2;
  ASSERT_OK_AND_ASSIGN(auto trainer,
                       Trainer::Create(*BuildGpt2(*Gpt2Config::Preset("tiny")), plan, options));
  ASSERT_OK(trainer->InitializeParameters(1));
  TokenDataset data = TokenDataset::Synthetic(5'000, 256, 3);
  ASSERT_OK_AND_ASSIGN(BatchSampler sampler,
                       BatchSampler::Create(data, plan.batch, plan.seq_len, 1));
  std::vector<int32_t> tokens(plan.batch * plan.seq_len), targets(tokens.size());
  for (int step = 0; step < 3; ++step) {
    sampler.Next(tokens.data(), targets.data());
    ASSERT_OK(Gpt2Step(*trainer, tokens, targets, 1e-3f).status());
  }
  ASSERT_OK_AND_ASSIGN(Timeline timeline, trainer->StepTimeline(2));
  std::set<uint64_t> instances;
  std::set<SpanKind> kinds;
  for (const TimelineSpan& span : timeline.spans) {
    instances.insert(span.instance);
    kinds.insert(span.kind);
    EXPECT_GE(span.end_us, span.start_us);
    EXPECT_GE(span.stream, 0);
    EXPECT_FALSE(span.name.empty());
  }
  EXPECT_EQ(instances, (std::set<uint64_t>{2, 3}));  // the last two of three steps
  EXPECT_TRUE(kinds.contains(SpanKind::kForward));
  EXPECT_TRUE(kinds.contains(SpanKind::kBackward));
  EXPECT_TRUE(kinds.contains(SpanKind::kOptimizer));
  ASSERT_EQ(timeline.processes.size(), 1u);
  EXPECT_GT(timeline.processes[0].pid, 0);
  ExpectChromeTraceSchema(ChromeTraceJson(timeline));

  EXPECT_EQ(trainer->backend().LastTimeline(99, 1).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tessera::testing
