// Traces of training steps on a local cluster of real worker processes: a ZeRO-3 GPT-2 step on
// two workers leaves, per worker, forward, backward, optimizer and collective spans, and its
// parameter all-gathers, the backward pass's too, run on the communication stream while compute
// goes on; layer-split
// placement shows pushes on the transfer stream; `tessera timeline` writes the same trace.
#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "client/trace.h"
#include "gpt2_test_util.h"
#include "plan_equivalence.h"
#include "test_util.h"
#include "trace_schema.h"
#include "training/token_dataset.h"
#include "training/trainer.h"

namespace tessera::testing {
namespace {

constexpr int64_t kBatch = 4;
constexpr int64_t kSeqLen = 64;

// GPT-2 tiny with six blocks of 128 channels: enough layers that a block's forward runs while the
// next blocks' parameters are gathered, and blocks long enough (a millisecond or two) for the
// operating system to run a worker's communication thread beside its compute thread. With two
// single-threaded workers on two cores, both cores are busy while both compute; a thread woken for
// a gather then waits for a core until the running task ends unless that task outlasts the
// scheduler's wakeup granularity (a few milliseconds): with 64-channel blocks of about 0.2 ms, the
// gathers of one run in two or three ran only between compute tasks, on both workers (none in
// 105 runs since, 25 of them beside a thread spinning on a core).
Gpt2Config Model() {
  Gpt2Config config = *Gpt2Config::Preset("tiny");
  config.layers = 6;
  config.channels = 128;
  return config;
}

Status TrainSteps(Trainer& trainer, int steps) {
  TESSERA_RETURN_IF_ERROR(trainer.InitializeParameters(5));
  TokenDataset data = TokenDataset::Synthetic(5'000, 256, 4);
  TESSERA_ASSIGN_OR_RETURN(BatchSampler sampler, BatchSampler::Create(data, kBatch, kSeqLen, 2));
  std::vector<int32_t> tokens(kBatch * kSeqLen), targets(tokens.size());
  for (int step = 0; step < steps; ++step) {
    sampler.Next(tokens.data(), targets.data());
    TESSERA_RETURN_IF_ERROR(Gpt2Step(trainer, tokens, targets, 1e-3f).status());
  }
  return Status::Ok();
}

bool Overlap(const TimelineSpan& a, const TimelineSpan& b) {
  return a.start_us < b.end_us && b.start_us < a.end_us;
}

class TraceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Result<std::unique_ptr<Cluster>> cluster = StartTestCluster(2);
    ASSERT_TRUE(cluster.ok()) << cluster.status().ToString();
    cluster_ = std::move(*cluster).release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  static Cluster* cluster_;
};

Cluster* TraceTest::cluster_ = nullptr;

TEST_F(TraceTest, Zero3StepShowsAllGathersOverlappingCompute) {
  TrainingPlan plan;
  plan.batch = kBatch;
  plan.seq_len = kSeqLen;
  plan.parallel.data_parallel = 2;
  plan.parallel.zero_stage = 3;
  ASSERT_OK_AND_ASSIGN(auto backend, MakeClusterBackend(*cluster_));
  ASSERT_OK_AND_ASSIGN(auto trainer,
                       Trainer::Create(*BuildGpt2(Model()), plan, std::move(backend)));
  // Whether one step's gathers overlap its compute depends on when the operating system runs
  // them (each takes tens of microseconds): the spans of eight steps are looked at together.
  constexpr int kTracedSteps = 8;
  ASSERT_OK(TrainSteps(*trainer, kTracedSteps + 1));
  ASSERT_OK_AND_ASSIGN(Timeline timeline, trainer->StepTimeline(kTracedSteps));

  std::set<uint64_t> instances;
  std::map<uint64_t, std::set<SpanKind>> kinds;  // per worker
  std::map<uint64_t, std::vector<const TimelineSpan*>> gathers, compute;
  for (const TimelineSpan& span : timeline.spans) {
    EXPECT_TRUE(span.worker.valid());
    EXPECT_GE(span.end_us, span.start_us) << span.name;
    EXPECT_FALSE(span.name.empty());
    instances.insert(span.instance);
    kinds[span.worker.value()].insert(span.kind);
    if (span.op == "all_gather" || span.op == "all_gather_in_place") {
      EXPECT_EQ(span.stream, kCollectiveStream) << span.name;
      EXPECT_EQ(span.kind, SpanKind::kCollective);
      EXPECT_GT(span.bytes, 0) << span.name;  // a member of a 2-rank gather sends its shard
      gathers[span.worker.value()].push_back(&span);
    }
    if (span.kind == SpanKind::kForward || span.kind == SpanKind::kBackward) {
      EXPECT_GE(span.stream, 0) << span.name;
      compute[span.worker.value()].push_back(&span);
    }
  }
  EXPECT_EQ(instances.size(), static_cast<size_t>(kTracedSteps));
  ASSERT_EQ(kinds.size(), 2u) << "spans from both workers";
  ASSERT_EQ(timeline.processes.size(), 2u);
  for (const TimelineProcess& process : timeline.processes) {
    EXPECT_GT(process.pid, 0);
    EXPECT_FALSE(process.hostname.empty());
  }
  // The plan pins each rank's tasks to a worker of its own: a worker's compute spans are one
  // rank's.
  std::map<uint64_t, std::set<std::string>> ranks;  // per worker: "rank0/", "rank1/"
  for (const auto& [worker, spans] : compute) {
    for (const TimelineSpan* span : spans) ranks[worker].insert(span->name.substr(0, 6));
  }
  for (const auto& [worker, seen] : ranks) {
    EXPECT_EQ(seen.size(), 1u) << "worker " << worker << " ran the compute of "
                               << fmt::format("{}", fmt::join(seen, ", "));
  }
  for (const auto& [worker, seen] : kinds) {
    SCOPED_TRACE(fmt::format("worker {}", worker));
    EXPECT_TRUE(seen.contains(SpanKind::kForward));
    EXPECT_TRUE(seen.contains(SpanKind::kBackward));
    EXPECT_TRUE(seen.contains(SpanKind::kOptimizer));
    EXPECT_TRUE(seen.contains(SpanKind::kCollective));
    bool overlapped = false;
    for (const TimelineSpan* gather : gathers[worker]) {
      for (const TimelineSpan* work : compute[worker]) overlapped |= Overlap(*gather, *work);
    }
    EXPECT_TRUE(overlapped) << "no all_gather overlaps a forward or backward span on worker "
                            << worker;
    // The backward pass's gathers too: on a channel of their own (core/collective_task.h), they
    // no longer queue behind the gradients' reduce-scatters, which wait for the backward compute.
    const OverlapFigures backward_gathers =
        HiddenUnderCompute(timeline, [worker = worker](const TimelineSpan& span) {
          return span.worker.value() == worker && span.kind == SpanKind::kCollective &&
                 span.name.find("/gather_") != std::string::npos &&
                 span.name.find("backward") != std::string::npos;
        });
    EXPECT_GT(backward_gathers.spans, 0) << "ZeRO-3 gathers parameters again for the backward";
    EXPECT_GT(backward_gathers.hidden_us, 0)
        << "no backward all_gather overlaps compute on worker " << worker << " ("
        << backward_gathers.spans << " gathers, " << backward_gathers.total_us << " us)";
  }

  const std::string path = ::testing::TempDir() + "/zero3_trace.json";
  ASSERT_OK(WriteChromeTrace(path, timeline));
  nlohmann::json trace = ExpectChromeTraceSchema(ReadFileText(path));
  ASSERT_FALSE(trace.is_null());
  std::set<std::string> process_names;
  for (const nlohmann::json& event : trace["traceEvents"]) {
    if (event["name"] == "process_name") process_names.insert(event["args"]["name"]);
  }
  EXPECT_EQ(process_names.size(), 2u);
  for (const std::string& name : process_names) EXPECT_EQ(name.rfind("worker ", 0), 0u) << name;

  // The CLI reads the same store (every graph: the latest instance may be another graph's).
  const std::string cli_path = ::testing::TempDir() + "/cli_trace.json";
  ProcessResult cli = RunBinary(
      "tessera", fmt::format("timeline --address {} --token-file {}/token --out {} --steps 1",
                             cluster_->address(), cluster_->session_dir(), cli_path));
  ASSERT_EQ(cli.exit_code, 0) << cli.output;
  EXPECT_NE(cli.output.find("wrote"), std::string::npos) << cli.output;
  ExpectChromeTraceSchema(ReadFileText(cli_path));
}

// The cluster's and each worker's count of tasks done count a training step's tasks (registered
// graphs' instances), not only submitted tasks: `tessera status`, the dashboard and /metrics read
// them.
TEST_F(TraceTest, TaskCountersCountATrainingStepsTasks) {
  ASSERT_OK_AND_ASSIGN(ClusterInfo before, cluster_->Info());
  TrainingPlan plan;
  plan.batch = kBatch;
  plan.seq_len = kSeqLen;
  plan.parallel.data_parallel = 2;
  ASSERT_OK_AND_ASSIGN(auto backend, MakeClusterBackend(*cluster_));
  ASSERT_OK_AND_ASSIGN(auto trainer,
                       Trainer::Create(*BuildGpt2(Model()), plan, std::move(backend)));
  constexpr int kSteps = 3;
  ASSERT_OK(TrainSteps(*trainer, kSteps));
  const int64_t step_tasks = static_cast<int64_t>(trainer->step_graph().graph.tasks().size());
  ASSERT_OK_AND_ASSIGN(ClusterInfo after, cluster_->Info());
  EXPECT_GE(after.tasks_done - before.tasks_done, kSteps * step_tasks);
  // Each worker's own count comes with its heartbeats: wait for one after the steps.
  std::map<uint64_t, int64_t> done_before;
  for (const WorkerInfo& worker : before.workers)
    done_before[worker.id.value()] = worker.tasks_done;
  int64_t workers_done = 0;
  for (int tries = 0; tries < 300 && workers_done < kSteps * step_tasks; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_OK_AND_ASSIGN(ClusterInfo now, cluster_->Info());
    workers_done = 0;
    for (const WorkerInfo& worker : now.workers) {
      workers_done += worker.tasks_done - done_before[worker.id.value()];
    }
  }
  EXPECT_GE(workers_done, kSteps * step_tasks)
      << "the workers' heartbeats count the tasks they ran";
}

TEST_F(TraceTest, LayerPlacementPushesShowOnTheTransferStream) {
  TrainingPlan plan;
  plan.batch = kBatch;
  plan.seq_len = kSeqLen;
  ASSERT_OK_AND_ASSIGN(auto backend,
                       MakeClusterBackend(*cluster_, ClusterPlacement::kLayersRoundRobin));
  ASSERT_OK_AND_ASSIGN(auto trainer,
                       Trainer::Create(*BuildGpt2(Model()), plan, std::move(backend)));
  ASSERT_OK(TrainSteps(*trainer, 1));
  ASSERT_OK_AND_ASSIGN(Timeline timeline, trainer->StepTimeline(1));
  int pushes = 0;
  for (const TimelineSpan& span : timeline.spans) {
    if (span.stream != kTransferStream) continue;
    ++pushes;
    EXPECT_EQ(span.kind, SpanKind::kTransfer);
    EXPECT_GT(span.bytes, 0);
    EXPECT_NE(span.name.find("push "), std::string::npos) << span.name;
  }
  EXPECT_GT(pushes, 0) << "activations and gradients cross workers layer by layer";
}

TEST(TraceCliTest, TimelineWithoutAClusterSaysWhatToDo) {
  ProcessResult missing_out = RunBinary("tessera", "timeline --address 127.0.0.1:1");
  EXPECT_EQ(missing_out.exit_code, 2) << missing_out.output;
  EXPECT_NE(missing_out.output.find("--out"), std::string::npos) << missing_out.output;
  ProcessResult nobody = RunBinary(
      "tessera", "timeline --address 127.0.0.1:1 --token-file /nonexistent/token --out /tmp/x");
  EXPECT_EQ(nobody.exit_code, 1) << nobody.output;
  EXPECT_NE(nobody.output.find("tessera: error:"), std::string::npos) << nobody.output;
}

}  // namespace
}  // namespace tessera::testing
