// The distributed runtime as a user sees it: a local cluster of real scheduler and worker
// processes, driven through the Cluster API.
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <thread>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "core/cpu_set.h"
#include "core/rpc/connection.h"
#include "core/rpc/wire.h"
#include "gpt2_test_util.h"
#include "ops/graph_builder.h"
#include "test_util.h"
#include "training/plan_calibration.h"
#include "training/token_dataset.h"
#include "training/trainer.h"
#include "worker/in_process_executor.h"

namespace tessera::testing {
namespace {

LocalClusterOptions Local(int workers, int64_t capacity_mb = 1024) {
  LocalClusterOptions options;
  options.cpu_workers = workers;
  options.threads_per_worker = 1;
  options.host_capacity_bytes = capacity_mb << 20;
  options.tessera_binary = BinaryPath("tessera");
  return options;
}

TEST(ClusterTest, PutSubmitGetThroughTheDataPlane) {
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(2)));
  // 4 MiB: held by the driver, pulled by a worker, pulled back by the driver.
  Tensor x = RandomTensor({1 << 20}, 1, 3.0f);
  ASSERT_OK_AND_ASSIGN(ObjectRef ref, cluster->Put(x));
  ASSERT_OK_AND_ASSIGN(auto out, cluster->Submit("gelu_forward", {ref}));
  ASSERT_OK_AND_ASSIGN(Tensor y, cluster->Get(out[0], 10'000));
  ASSERT_OK_AND_ASSIGN(auto expected, RunKernel("gelu_forward", {x}));
  EXPECT_EQ(ToVector(y), ToVector(expected[0]));
  // Small objects travel inline; a chain of dependent tasks.
  ASSERT_OK_AND_ASSIGN(ObjectRef a, cluster->Put(FloatTensor({3}, {1, 2, 3})));
  ObjectRef sum = a;
  for (int i = 0; i < 50; ++i) sum = (*cluster->Submit("add_forward", {sum, a}))[0];
  ASSERT_OK_AND_ASSIGN(Tensor total, cluster->Get(sum, 10'000));
  EXPECT_EQ(ToVector(total), (std::vector<float>{51, 102, 153}));
  ASSERT_OK_AND_ASSIGN(ClusterInfo info, cluster->Info());
  EXPECT_EQ(info.workers.size(), 2u);
  EXPECT_GE(info.tasks_done, 51);
}

// bind_cores: each worker runs on the cores AssignCores gives it and says so when it joins; the
// simulation's groups of shared cores follow (CoreGroupsOf).
TEST(ClusterTest, WorkersBoundToCoresRunThereAndSaySo) {
  ASSERT_OK_AND_ASSIGN(const std::vector<int> cpus, ProcessCpus());
  LocalClusterOptions options = Local(3);
  options.bind_cores = true;
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(options));
  ASSERT_OK_AND_ASSIGN(ClusterInfo info, cluster->Info());
  ASSERT_EQ(info.workers.size(), 3u);
  ASSERT_OK_AND_ASSIGN(auto expected, AssignCores(cpus, 3, 1));
  std::multiset<std::string> said, assigned;
  std::vector<WorkerId> ids;
  for (const WorkerInfo& worker : info.workers) {
    said.insert(worker.cpus);
    ids.push_back(worker.id);
    // The kernel's own word on the worker's process.
    std::ifstream status(fmt::format("/proc/{}/status", worker.pid));
    std::string line, allowed;
    while (std::getline(status, line)) {
      if (line.rfind("Cpus_allowed_list:", 0) == 0) {
        allowed = line.substr(line.find_last_of(" \t") + 1);
      }
    }
    EXPECT_EQ(allowed, worker.cpus) << worker.id.value();
  }
  for (const std::vector<int>& set : expected) assigned.insert(FormatCpuList(set));
  EXPECT_EQ(said, assigned);
  const std::vector<CoreGroup> groups = CoreGroupsOf(info.workers, ids);
  if (cpus.size() >= 2) {
    // Three workers on 2+ CPUs: on 2, the first and third share one; on more, each its own.
    EXPECT_EQ(groups.size(), cpus.size() == 2 ? 2u : 3u);
  } else {
    EXPECT_TRUE(groups.empty());  // all on the one CPU: the whole machine's sharing
  }
}

TEST(ClusterTest, SubmitReportsShapeErrorsAtOnce) {
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(1)));
  ASSERT_OK_AND_ASSIGN(ObjectRef a, cluster->Put(RandomTensor({4, 8}, 1)));
  ASSERT_OK_AND_ASSIGN(ObjectRef b, cluster->Put(RandomTensor({5, 3}, 2)));
  Result<std::vector<ObjectRef>> bad = cluster->Submit("matmul_forward", {a, b});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("matmul_forward"), std::string::npos);
  EXPECT_NE(bad.status().message().find("[4, 8]"), std::string::npos);
  EXPECT_NE(bad.status().message().find("[5, 3]"), std::string::npos);
  EXPECT_EQ(cluster->Submit("no_such_op", {a}).status().code(), StatusCode::kNotFound);
}

TEST(ClusterTest, ObjectsBeyondAWorkersCapacitySpillAndComeBackIntact) {
  // 8 MiB of host tier; 12 objects of 2 MiB each must spill.
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(1, /*capacity_mb=*/8)));
  ASSERT_OK_AND_ASSIGN(ObjectRef seed, cluster->Put(RandomTensor({1 << 19}, 7)));
  std::vector<ObjectRef> outputs;
  std::vector<Tensor> expected;
  Tensor base = *cluster->Get(seed, 10'000);
  for (int i = 0; i < 12; ++i) {
    ASSERT_OK_AND_ASSIGN(auto out, cluster->Submit("sleep", {seed}, Attrs{{"ms", int64_t{0}}}));
    outputs.push_back(out[0]);
  }
  ASSERT_OK(cluster->Wait(outputs, 20'000));
  // A heartbeat reports the spill.
  EXPECT_TRUE(Eventually([&] {
    Result<ClusterInfo> info = cluster->Info();
    return info.ok() && info->workers.size() == 1 && info->workers[0].spilled_bytes > 0;
  })) << "12 x 2 MiB cannot fit in 8 MiB, but no spill was reported";
  for (const ObjectRef& out : outputs) {
    ASSERT_OK_AND_ASSIGN(Tensor value, cluster->Get(out, 10'000));
    EXPECT_EQ(ToVector(value), ToVector(base));
  }
}

// A worker dies holding the only copies of two task outputs. One is rebuilt from its lineage on
// the other worker (its task runs again from the driver's Put); the other cannot be (the driver
// let go of the Put it came from) and fails naming the dead worker. A task running there is
// retried elsewhere.
TEST(ClusterTest, AKilledWorkersObjectsAreRebuiltOrFailWithItsNameAndTasksRetryElsewhere) {
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(2)));
  ASSERT_OK_AND_ASSIGN(ClusterInfo info, cluster->Info());
  ASSERT_EQ(info.workers.size(), 2u);
  const WorkerInfo victim = info.workers[0];
  SubmitOptions on_victim;
  on_victim.pinned_worker = victim.id;
  // 4 MiB each: not inline, so the only copies are on the victim.
  const Tensor kept_input = RandomTensor({1 << 20}, 3);
  ASSERT_OK_AND_ASSIGN(ObjectRef kept, cluster->Put(kept_input));
  ASSERT_OK_AND_ASSIGN(auto rebuildable, cluster->Submit("gelu_forward", {kept}, {}, on_victim));
  std::vector<ObjectRef> unrebuildable;
  {
    ASSERT_OK_AND_ASSIGN(ObjectRef dropped, cluster->Put(RandomTensor({1 << 20}, 4)));
    ASSERT_OK_AND_ASSIGN(unrebuildable, cluster->Submit("gelu_forward", {dropped}, {}, on_victim));
    ASSERT_OK(cluster->Wait(unrebuildable, 10'000));
  }  // the driver lets go of the Put: it is freed, and nothing could make it again
  ASSERT_OK(cluster->Wait(rebuildable, 10'000));
  // A slow task is running when the worker dies: it must be retried on the other worker.
  ASSERT_OK_AND_ASSIGN(ObjectRef small, cluster->Put(FloatTensor({2}, {4, 5})));
  std::vector<ObjectRef> slow;
  slow.reserve(2);
  for (int i = 0; i < 2; ++i) {
    slow.push_back((*cluster->Submit("sleep", {small}, Attrs{{"ms", int64_t{1500}}}))[0]);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto killed_at = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(victim.pid, SIGKILL), 0);

  ASSERT_OK_AND_ASSIGN(Tensor rebuilt, cluster->Get(rebuildable[0], 20'000));
  ASSERT_OK_AND_ASSIGN(auto expected, RunKernel("gelu_forward", {kept_input}));
  EXPECT_EQ(ToVector(rebuilt), ToVector(expected[0])) << "rebuilt from its lineage";
  std::printf("rebuilt a lost object %.2f s after its worker was killed\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count());
  Result<Tensor> lost = cluster->Get(unrebuildable[0], 10'000);
  ASSERT_FALSE(lost.ok()) << "its only copy died with its worker, and its input is gone";
  EXPECT_NE(lost.status().message().find(victim.id.ToString()), std::string::npos)
      << lost.status().ToString();
  EXPECT_NE(lost.status().message().find("died"), std::string::npos) << lost.status().ToString();
  // A new task on the lost object fails naming it; one on the rebuilt object runs.
  ASSERT_OK_AND_ASSIGN(auto after, cluster->Submit("gelu_forward", {unrebuildable[0]}));
  EXPECT_FALSE(cluster->Get(after[0], 10'000).ok());
  ASSERT_OK_AND_ASSIGN(auto onward, cluster->Submit("gelu_forward", {rebuildable[0]}));
  EXPECT_OK(cluster->Wait(onward, 10'000));
  // The slow tasks finish: whichever ran on the dead worker was retried.
  for (const ObjectRef& ref : slow) {
    ASSERT_OK_AND_ASSIGN(Tensor value, cluster->Get(ref, 15'000));
    EXPECT_EQ(ToVector(value), (std::vector<float>{4, 5}));
  }
}

// A worker of a local cluster that dies while the driver (this test) runs on is reaped by the
// driver, not left a zombie child until it exits; the other processes are left alone.
TEST(ClusterTest, AKilledWorkerIsReapedWhileTheDriverRuns) {
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(2)));
  ASSERT_OK_AND_ASSIGN(ClusterInfo info, cluster->Info());
  ASSERT_EQ(info.workers.size(), 2u);
  const int victim = info.workers[0].pid;
  const std::vector<pid_t> started = cluster->local_processes();
  ASSERT_EQ(started.size(), 3u) << "the scheduler and two workers";
  ASSERT_NE(std::find(started.begin(), started.end(), victim), started.end());
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  const std::string stat = "/proc/" + std::to_string(victim) + "/stat";
  // Gone from /proc altogether: reaped (a zombie keeps its entry, in state Z).
  EXPECT_TRUE(Eventually([&] { return !std::filesystem::exists(stat); }, std::chrono::seconds(10)))
      << "pid " << victim << " is still in /proc: " << ReadFileText(stat);
  EXPECT_TRUE(
      Eventually([&] { return cluster->local_processes().size() == 2; }, std::chrono::seconds(10)));
  for (pid_t pid : cluster->local_processes()) EXPECT_FALSE(ProcessGone(pid)) << pid;
}

// A chain of three tasks whose intermediates the driver let go of: its last object, lost with its
// worker, comes back from a rerun of the whole chain on the worker that survives.
TEST(ClusterTest, AChainOfThreeIsRebuiltFromItsLineage) {
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(2)));
  ASSERT_OK_AND_ASSIGN(ClusterInfo info, cluster->Info());
  const WorkerInfo victim = info.workers[1];
  SubmitOptions on_victim;
  on_victim.pinned_worker = victim.id;
  const Tensor x = RandomTensor({1 << 20}, 8);
  ASSERT_OK_AND_ASSIGN(ObjectRef input, cluster->Put(x));
  ObjectRef last;
  {
    ObjectRef link = input;
    for (int i = 0; i < 3; ++i) {
      ASSERT_OK_AND_ASSIGN(auto next, cluster->Submit("gelu_forward", {link}, {}, on_victim));
      link = next[0];
    }
    last = link;
    ASSERT_OK(cluster->Wait({last}, 10'000));
  }  // the intermediates are let go of and freed
  ASSERT_EQ(::kill(victim.pid, SIGKILL), 0);
  ASSERT_OK_AND_ASSIGN(Tensor value, cluster->Get(last, 20'000));
  Tensor expected = x;
  for (int i = 0; i < 3; ++i) expected = (*RunKernel("gelu_forward", {expected}))[0];
  EXPECT_EQ(ToVector(value), ToVector(expected));
}

// Raw connections to the scheduler: garbage, and valid messages that make no sense.
TEST(ClusterTest, TheSchedulerSurvivesGarbageAndWrongMessages) {
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(1)));
  ASSERT_OK_AND_ASSIGN(rpc::Address address, rpc::Address::Parse(cluster->address()));
  rpc::asio::io_context io;
  std::mt19937_64 rng(3);
  for (int round = 0; round < 30; ++round) {
    ASSERT_OK_AND_ASSIGN(rpc::GenericSocket socket, rpc::ConnectSocket(io, address, 2000));
    std::vector<uint8_t> bytes;
    if (round % 3 == 0) {
      bytes.resize(1 + rng() % 4096);  // pure garbage
      for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    } else {
      // A well-formed frame of a random kind with random contents, no Hello first.
      capnp::MallocMessageBuilder message;
      auto body = message.initRoot<proto::Envelope>().initBody();
      if (round % 3 == 1) {
        auto result = body.initTasksFinished().initResults(3);
        for (unsigned i = 0; i < 3; ++i) result[i].setTask(rng());
      } else {
        auto hello = body.initHello();
        hello.setProtocolVersion(rpc::kProtocolVersion);
        hello.setToken("not-the-token");
      }
      bytes = rpc::EncodeFrame(message);
      if (round % 2 == 0) bytes.resize(bytes.size() / 2);  // truncated
    }
    boost::system::error_code ignored;
    rpc::asio::write(socket, rpc::asio::buffer(bytes), ignored);
    socket.close(ignored);
  }
  // Still serving: new tasks run and status answers.
  ASSERT_OK_AND_ASSIGN(ObjectRef a, cluster->Put(FloatTensor({1}, {2})));
  ASSERT_OK_AND_ASSIGN(auto out, cluster->Submit("add_forward", {a, a}));
  ASSERT_OK_AND_ASSIGN(Tensor value, cluster->Get(out[0], 10'000));
  EXPECT_EQ(value.data<float>()[0], 4.0f);
  EXPECT_OK(cluster->Info().status());
}

// x -> gelu (worker A) -> y -> gelu (worker B) -> z; out = z + x (worker A): objects cross in both
// directions and the bound input is read on both workers.
TEST(ClusterTest, ARegisteredGraphSplitAcrossWorkersMatchesTheInProcessRun) {
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(2)));
  ASSERT_OK_AND_ASSIGN(ClusterInfo info, cluster->Info());
  ASSERT_EQ(info.workers.size(), 2u);
  const WorkerId a = info.workers[0].id, b = info.workers[1].id;
  GraphBuilder builder(CpuRegistry());
  const TensorMeta meta{Shape{1 << 18}, DType::kF32, Device::Cpu()};  // 1 MiB: not inline
  ObjectId x = builder.AddInput("x", meta, ObjectRole::kInput);
  TaskOptions on_a, on_b;
  on_a.pinned_worker = a;
  on_b.pinned_worker = b;
  ObjectId y = (*builder.AddTask("g1", "gelu_forward", {x}, {}, on_a))[0];
  ObjectId z = (*builder.AddTask("g2", "gelu_forward", {y}, {}, on_b))[0];
  ObjectId out = (*builder.AddTask("sum", "add_forward", {z, x}, {}, on_a))[0];
  builder.MarkOutput(out);
  ASSERT_OK_AND_ASSIGN(Graph graph, builder.Build());
  ASSERT_OK_AND_ASSIGN(GraphHandle handle, cluster->RegisterGraph(graph));

  InProcessExecutor local(CpuRegistry(), ExecutorOptions{});
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, local.Prepare(graph));
  for (int instance = 0; instance < 3; ++instance) {
    Tensor input = RandomTensor({1 << 18}, 10 + instance, 2.0f);
    ASSERT_OK_AND_ASSIGN(ObjectRef bound, cluster->Put(input));
    ASSERT_OK_AND_ASSIGN(auto outputs, cluster->RunGraph(handle, {{x, bound}}));
    ASSERT_OK_AND_ASSIGN(Tensor result, cluster->Get(outputs.at(out), 20'000));
    ASSERT_OK_AND_ASSIGN(RunResult expected, local.Run(prepared, {{x, input}}));
    EXPECT_EQ(ToVector(result), ToVector(expected.outputs.at(out))) << "instance " << instance;
  }
  // A pin to a worker that does not exist is refused at registration.
  GraphBuilder bad(CpuRegistry());
  ObjectId bx = bad.AddInput("x", meta, ObjectRole::kInput);
  TaskOptions nowhere;
  nowhere.pinned_worker = WorkerId(999);
  bad.MarkOutput((*bad.AddTask("g", "gelu_forward", {bx}, {}, nowhere))[0]);
  Result<GraphHandle> refused = cluster->RegisterGraph(*bad.Build());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("worker999"), std::string::npos)
      << refused.status().ToString();
}

// The GPT-2 tiny step graph with its layers dealt round-robin over two workers (activations and
// gradients cross processes every step) computes exactly what the in-process executor does.
TEST(ClusterTest, Gpt2TinyStepsOnTwoWorkersMatchTheInProcessLossesExactly) {
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(2)));
  const Gpt2Config config = *Gpt2Config::Preset("tiny");
  TrainingPlan plan;
  plan.batch = 4;
  plan.seq_len = 64;
  ASSERT_OK_AND_ASSIGN(auto local, Trainer::Create(*BuildGpt2(config), plan, ExecutorOptions{}));
  ASSERT_OK_AND_ASSIGN(auto backend,
                       MakeClusterBackend(*cluster, ClusterPlacement::kLayersRoundRobin));
  ASSERT_OK_AND_ASSIGN(auto distributed,
                       Trainer::Create(*BuildGpt2(config), plan, std::move(backend)));
  ASSERT_OK(local->InitializeParameters(5));
  ASSERT_OK(distributed->InitializeParameters(5));
  TokenDataset data = TokenDataset::Synthetic(10'000, 256, 9);
  ASSERT_OK_AND_ASSIGN(BatchSampler sampler, BatchSampler::Create(data, 4, 64, 3));
  std::vector<int32_t> tokens(256), targets(256);
  for (int step = 0; step < 8; ++step) {
    sampler.Next(tokens.data(), targets.data());
    ASSERT_OK_AND_ASSIGN(StepReport a, Gpt2Step(*local, tokens, targets, 3e-3f));
    ASSERT_OK_AND_ASSIGN(StepReport b, Gpt2Step(*distributed, tokens, targets, 3e-3f));
    EXPECT_EQ(a.loss, b.loss) << "step " << step;
    EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << step;
  }
  ASSERT_OK_AND_ASSIGN(float eval_a, Gpt2EvalLoss(*local, tokens, targets));
  ASSERT_OK_AND_ASSIGN(float eval_b, Gpt2EvalLoss(*distributed, tokens, targets));
  EXPECT_EQ(eval_a, eval_b);
  ASSERT_OK_AND_ASSIGN(auto logits_a, Gpt2Logits(*local, tokens, 4, 64));
  ASSERT_OK_AND_ASSIGN(auto logits_b, Gpt2Logits(*distributed, tokens, 4, 64));
  EXPECT_EQ(logits_a, logits_b);
  EXPECT_EQ(*local->GetParameter("h.1.fc_w"), *distributed->GetParameter("h.1.fc_w"));
  // Both workers did work: each holds some of the layers and pushed activations or gradients
  // to the other (counters arrive with the next heartbeat).
  ClusterInfo info;
  EXPECT_TRUE(Eventually([&] {
    Result<ClusterInfo> latest = cluster->Info();
    if (!latest.ok()) return false;
    info = *latest;
    return std::all_of(info.workers.begin(), info.workers.end(),
                       [](const WorkerInfo& worker) { return worker.bytes_served > 0; });
  }));
  for (const WorkerInfo& worker : info.workers)
    EXPECT_GT(worker.bytes_served, 0) << worker.id.ToString();
}

TEST(ClusterTest, AJoinWithoutTheTokenIsRefused) {
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(1)));
  ConnectOptions wrong;
  wrong.token = "0123456789abcdef";
  Result<std::unique_ptr<Cluster>> intruder = Cluster::Connect(cluster->address(), wrong);
  ASSERT_FALSE(intruder.ok());
  EXPECT_NE(intruder.status().message().find("invalid cluster token"), std::string::npos)
      << intruder.status().ToString();
  // The token file is readable only by its owner.
  struct stat info {};
  ASSERT_EQ(::stat((cluster->session_dir() + "/token").c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0600);
  // Nothing answers at an unused port: a clear error, not a hang.
  Result<std::unique_ptr<Cluster>> nowhere = Cluster::Connect("127.0.0.1:1", wrong);
  ASSERT_FALSE(nowhere.ok());
  EXPECT_EQ(nowhere.status().code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace tessera::testing
