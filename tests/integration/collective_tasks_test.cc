// Collective tasks in the runtime: members of all-reduce, reduce-scatter, all-gather, all-to-all
// and broadcast placed on real worker processes, their communicators formed through the scheduler,
// checked against the values computed here; and a member's worker dying mid-collective.
#include <signal.h>

#include <chrono>
#include <thread>

#include "client/cluster.h"
#include "core/collective_task.h"
#include "core/exchange_layout.h"
#include "ops/graph_builder.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using Clock = std::chrono::steady_clock;

LocalClusterOptions Local(int workers) {
  LocalClusterOptions options;
  options.cpu_workers = workers;
  options.threads_per_worker = 1;
  options.host_capacity_bytes = int64_t{512} << 20;
  options.tessera_binary = BinaryPath("tessera");
  return options;
}

Attrs Member(int64_t collective, int rank, int size) {
  return Attrs{{"collective", collective}, {"rank", int64_t{rank}}, {"group_size", int64_t{size}}};
}

// Per rank r: x_r -> all_reduce(sum) -> reduce_scatter(max) -> all_gather -> broadcast(root 1).
struct CollectiveChain {
  Graph graph;
  std::vector<ObjectId> inputs, reduced, scattered, gathered, broadcast;
};

CollectiveChain BuildChain(int n, int64_t numel, const std::vector<WorkerId>& pins) {
  GraphBuilder builder(CpuRegistry());
  CollectiveChain chain;
  const TensorMeta meta{Shape{numel}, DType::kF32, Device::Cpu()};
  for (int r = 0; r < n; ++r) {
    TaskOptions options;
    if (!pins.empty()) options.pinned_worker = pins[static_cast<size_t>(r)];
    const std::string rank = std::to_string(r);
    ObjectId x = builder.AddInput(fmt::format("x{}", rank), meta, ObjectRole::kGradient);
    ObjectId y = (*builder.AddTask("all_reduce." + rank, "all_reduce", {x},
                                   Member(1, r, n).Set("reduce", std::string("sum")), options))[0];
    ObjectId z = (*builder.AddTask("reduce_scatter." + rank, "reduce_scatter", {y},
                                   Member(2, r, n).Set("reduce", std::string("max")), options))[0];
    ObjectId w =
        (*builder.AddTask("all_gather." + rank, "all_gather", {z}, Member(3, r, n), options))[0];
    ObjectId b = (*builder.AddTask("broadcast." + rank, "broadcast", {w},
                                   Member(4, r, n).Set("root", int64_t{1}), options))[0];
    for (ObjectId out : {y, z, w, b}) builder.MarkOutput(out);
    chain.inputs.push_back(x);
    chain.reduced.push_back(y);
    chain.scattered.push_back(z);
    chain.gathered.push_back(w);
    chain.broadcast.push_back(b);
  }
  chain.graph = *builder.Build();
  return chain;
}

void RunChainAndCheck(Cluster& cluster, const CollectiveChain& chain, int n, int64_t numel,
                      int instances) {
  ASSERT_OK_AND_ASSIGN(GraphHandle handle, cluster.RegisterGraph(chain.graph));
  for (int instance = 0; instance < instances; ++instance) {
    std::vector<std::vector<float>> values(static_cast<size_t>(n));
    std::map<ObjectId, ObjectRef> bound;
    for (int r = 0; r < n; ++r) {
      // Small integers: sums are exact in any order.
      std::vector<float>& v = values[static_cast<size_t>(r)];
      for (int64_t i = 0; i < numel; ++i)
        v.push_back(static_cast<float>((i * 7 + int64_t{r} * 3 + instance) % 11));
      ASSERT_OK_AND_ASSIGN(bound[chain.inputs[static_cast<size_t>(r)]],
                           cluster.Put(FloatTensor({numel}, v)));
    }
    std::vector<float> sum(static_cast<size_t>(numel), 0);
    for (const auto& v : values) {
      for (int64_t i = 0; i < numel; ++i) sum[static_cast<size_t>(i)] += v[static_cast<size_t>(i)];
    }
    ASSERT_OK_AND_ASSIGN(auto outputs, cluster.RunGraph(handle, bound));
    for (int r = 0; r < n; ++r) {
      const size_t rr = static_cast<size_t>(r);
      ASSERT_OK_AND_ASSIGN(Tensor reduced, cluster.Get(outputs.at(chain.reduced[rr]), 30'000));
      EXPECT_EQ(ToVector(reduced), sum) << "all-reduce, rank " << r << ", instance " << instance;
      // Every rank holds the same sums, so the max-reduce-scatter hands rank r block r of them.
      const int64_t block = numel / n;
      std::vector<float> expected_block(sum.begin() + r * block, sum.begin() + (r + 1) * block);
      ASSERT_OK_AND_ASSIGN(Tensor scattered, cluster.Get(outputs.at(chain.scattered[rr]), 30'000));
      EXPECT_EQ(ToVector(scattered), expected_block) << "reduce-scatter, rank " << r;
      ASSERT_OK_AND_ASSIGN(Tensor gathered, cluster.Get(outputs.at(chain.gathered[rr]), 30'000));
      EXPECT_EQ(ToVector(gathered), sum) << "all-gather, rank " << r;
      ASSERT_OK_AND_ASSIGN(Tensor broadcast, cluster.Get(outputs.at(chain.broadcast[rr]), 30'000));
      EXPECT_EQ(ToVector(broadcast), sum) << "broadcast, rank " << r;
    }
  }
}

TEST(CollectiveTasksTest, PinnedMembersOnThreeWorkersMatchTheReference) {
  const int n = 3;
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(n)));
  ASSERT_OK_AND_ASSIGN(ClusterInfo info, cluster->Info());
  std::vector<WorkerId> pins;
  pins.reserve(info.workers.size());
  for (const WorkerInfo& worker : info.workers) pins.push_back(worker.id);
  // 300k elements (1.2 MB): the ring, in chunks; three instances reuse the communicators.
  const int64_t numel = 300'000;
  RunChainAndCheck(*cluster, BuildChain(n, numel, pins), n, numel, 3);
}

// Per rank r: x_r -> all_to_all -> all_to_all (on channel 2, as tensor parallelism's would run).
// The first hands rank r block r of every rank's x, in rank order; the second, the transpose of
// the transpose, gives every rank its x back (Ulysses' exchange before attention and after).
// Beside them x_r -> ring_next -> ring_previous (ring attention's rotation and its adjoint): rank r
// receives rank r - 1's whole x, and the rotation back gives it its own.
TEST(CollectiveTasksTest, AllToAllMembersExchangeBlocksAndTheSecondUndoesTheFirst) {
  const int n = 3;
  const int64_t block = 100'001;  // odd; 1.2 MB per rank
  const int64_t numel = block * n;
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(n)));
  ASSERT_OK_AND_ASSIGN(ClusterInfo info, cluster->Info());
  GraphBuilder builder(CpuRegistry());
  const TensorMeta meta{Shape{numel}, DType::kF32, Device::Cpu()};
  std::vector<ObjectId> inputs, exchanged, restored, rotated, rotated_back;
  for (int r = 0; r < n; ++r) {
    TaskOptions options;
    options.pinned_worker = info.workers[static_cast<size_t>(r)].id;
    ObjectId x = builder.AddInput(fmt::format("x{}", r), meta, ObjectRole::kInput);
    ObjectId y =
        (*builder.AddTask(fmt::format("sequence_to_heads.{}", r), "all_to_all", {x},
                          Member(1, r, n).Set(kChannelAttr, int64_t{kTensorChannel}), options))[0];
    ObjectId z =
        (*builder.AddTask(fmt::format("heads_to_sequence.{}", r), "all_to_all", {y},
                          Member(2, r, n).Set(kChannelAttr, int64_t{kTensorChannel}), options))[0];
    Attrs next = Member(3, r, n).Set(kChannelAttr, int64_t{kTensorChannel});
    next.Set(kLayoutAttr, std::string(ExchangeLayoutName(ExchangeLayout::kRingNext)));
    Attrs previous = Member(4, r, n).Set(kChannelAttr, int64_t{kTensorChannel});
    previous.Set(kLayoutAttr, std::string(ExchangeLayoutName(ExchangeLayout::kRingPrevious)));
    ObjectId w =
        (*builder.AddTask(fmt::format("ring_next.{}", r), "all_to_all", {x}, next, options))[0];
    ObjectId v = (*builder.AddTask(fmt::format("ring_previous.{}", r), "all_to_all", {w}, previous,
                                   options))[0];
    for (ObjectId out : {y, z, w, v}) builder.MarkOutput(out);
    inputs.push_back(x);
    exchanged.push_back(y);
    restored.push_back(z);
    rotated.push_back(w);
    rotated_back.push_back(v);
  }
  ASSERT_OK_AND_ASSIGN(GraphHandle handle, cluster->RegisterGraph(*builder.Build()));
  for (int instance = 0; instance < 2; ++instance) {
    // Element i of rank r's x: distinct across ranks and instances, exact in f32.
    auto value = [&](int r, int64_t i) {
      return static_cast<float>(r * 1'000'000 + instance * 500'000 + i);
    };
    std::map<ObjectId, ObjectRef> bound;
    std::vector<std::vector<float>> xs(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      for (int64_t i = 0; i < numel; ++i) xs[static_cast<size_t>(r)].push_back(value(r, i));
      ASSERT_OK_AND_ASSIGN(bound[inputs[static_cast<size_t>(r)]],
                           cluster->Put(FloatTensor({numel}, xs[static_cast<size_t>(r)])));
    }
    ASSERT_OK_AND_ASSIGN(auto outputs, cluster->RunGraph(handle, bound));
    for (int r = 0; r < n; ++r) {
      const size_t rr = static_cast<size_t>(r);
      std::vector<float> expected;
      for (int source = 0; source < n; ++source) {
        for (int64_t i = 0; i < block; ++i) expected.push_back(value(source, r * block + i));
      }
      ASSERT_OK_AND_ASSIGN(Tensor y, cluster->Get(outputs.at(exchanged[rr]), 30'000));
      EXPECT_EQ(ToVector(y), expected)
          << "first all-to-all, rank " << r << ", instance " << instance;
      ASSERT_OK_AND_ASSIGN(Tensor z, cluster->Get(outputs.at(restored[rr]), 30'000));
      EXPECT_EQ(ToVector(z), xs[rr])
          << "second all-to-all, rank " << r << ", instance " << instance;
      ASSERT_OK_AND_ASSIGN(Tensor w, cluster->Get(outputs.at(rotated[rr]), 30'000));
      EXPECT_EQ(ToVector(w), xs[static_cast<size_t>((r + n - 1) % n)])
          << "ring_next, rank " << r << ", instance " << instance;
      ASSERT_OK_AND_ASSIGN(Tensor v, cluster->Get(outputs.at(rotated_back[rr]), 30'000));
      EXPECT_EQ(ToVector(v), xs[rr]) << "ring_previous, rank " << r << ", instance " << instance;
    }
  }
}

TEST(CollectiveTasksTest, UnpinnedMembersAreSpreadOverDistinctWorkers) {
  const int n = 2;
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(n)));
  const int64_t numel = 1000;  // the direct algorithm
  RunChainAndCheck(*cluster, BuildChain(n, numel, {}), n, numel, 2);
  // Three members cannot fit on two workers: refused before running, saying what to change.
  Result<GraphHandle> refused = cluster->RegisterGraph(BuildChain(3, 999, {}).graph);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("only 2 workers are alive"), std::string::npos)
      << refused.status().ToString();
}

TEST(CollectiveTasksTest, AWorkerKilledMidCollectiveFailsTheStepNamingIt) {
  const int n = 3;
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(n)));
  ASSERT_OK_AND_ASSIGN(ClusterInfo info, cluster->Info());
  // Rank 2's member waits behind a slow task: ranks 0 and 1 are inside the all-reduce, waiting
  // for it, when its worker is killed.
  GraphBuilder builder(CpuRegistry());
  const TensorMeta meta{Shape{1 << 16}, DType::kF32, Device::Cpu()};
  std::vector<ObjectId> inputs, outputs;
  for (int r = 0; r < n; ++r) {
    TaskOptions options;
    options.pinned_worker = info.workers[static_cast<size_t>(r)].id;
    ObjectId x = builder.AddInput(fmt::format("x{}", r), meta, ObjectRole::kGradient);
    if (r == 2) {
      x = (*builder.AddTask("slow", "sleep", {x}, Attrs{{"ms", int64_t{60'000}}}, options))[0];
    }
    ObjectId y = (*builder.AddTask(fmt::format("all_reduce.{}", r), "all_reduce", {x},
                                   Member(1, r, n).Set("reduce", std::string("sum")), options))[0];
    builder.MarkOutput(y);
    inputs.push_back(builder.graph().InputObjects()[static_cast<size_t>(r)]);
    outputs.push_back(y);
  }
  ASSERT_OK_AND_ASSIGN(GraphHandle handle, cluster->RegisterGraph(*builder.Build()));
  std::map<ObjectId, ObjectRef> bound;
  for (int r = 0; r < n; ++r) {
    ASSERT_OK_AND_ASSIGN(bound[inputs[static_cast<size_t>(r)]],
                         cluster->Put(RandomTensor({1 << 16}, 1)));
  }
  ASSERT_OK_AND_ASSIGN(auto result, cluster->RunGraph(handle, bound));
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // ranks 0 and 1 are waiting
  const WorkerInfo& victim = info.workers[2];
  ::kill(victim.pid, SIGKILL);
  // The collective deadline is 30 s; the failure must come from the death, well before.
  Result<Tensor> rank0 = cluster->Get(result.at(outputs[0]), 15'000);
  ASSERT_FALSE(rank0.ok());
  EXPECT_NE(rank0.status().code(), StatusCode::kTimedOut) << rank0.status().ToString();
  EXPECT_NE(rank0.status().message().find(victim.id.ToString()), std::string::npos)
      << rank0.status().ToString();
  EXPECT_NE(rank0.status().message().find("died"), std::string::npos) << rank0.status().ToString();
  std::printf("the step failed with: %s\n", rank0.status().ToString().c_str());
}

// Submitted one by one, the members of a collective are held until all are ready and then
// dispatched together to distinct workers.
TEST(CollectiveTasksTest, DynamicallySubmittedMembersAreDispatchedTogether) {
  const int n = 3;
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(n)));
  const int64_t numel = 200'000;
  std::vector<ObjectRef> reduced, gathered;
  std::vector<float> sum(static_cast<size_t>(numel), 0);
  for (int r = 0; r < n; ++r) {
    std::vector<float> v;
    for (int64_t i = 0; i < numel; ++i) v.push_back(static_cast<float>((i + r) % 5));
    for (int64_t i = 0; i < numel; ++i) sum[static_cast<size_t>(i)] += v[static_cast<size_t>(i)];
    ASSERT_OK_AND_ASSIGN(ObjectRef x, cluster->Put(FloatTensor({numel}, v)));
    // Rank 0's input comes late, from a slow task: the others wait for it, undispatched.
    if (r == 0) x = (*cluster->Submit("sleep", {x}, Attrs{{"ms", int64_t{500}}}))[0];
    ASSERT_OK_AND_ASSIGN(
        auto y,
        cluster->Submit("all_reduce", {x}, Member(7, r, n).Set("reduce", std::string("sum"))));
    reduced.push_back(y[0]);
  }
  for (int r = 0; r < n; ++r) {
    ASSERT_OK_AND_ASSIGN(
        auto z, cluster->Submit("all_gather", {reduced[static_cast<size_t>(r)]}, Member(8, r, n)));
    gathered.push_back(z[0]);
  }
  for (int r = 0; r < n; ++r) {
    ASSERT_OK_AND_ASSIGN(Tensor y, cluster->Get(reduced[static_cast<size_t>(r)], 30'000));
    EXPECT_EQ(ToVector(y), sum) << "rank " << r;
    ASSERT_OK_AND_ASSIGN(Tensor z, cluster->Get(gathered[static_cast<size_t>(r)], 30'000));
    std::vector<float> expected;
    for (int k = 0; k < n; ++k) expected.insert(expected.end(), sum.begin(), sum.end());
    EXPECT_EQ(ToVector(z), expected) << "rank " << r;
  }
}

// A member's worker that stops answering (SIGSTOP: alive, silent) while the others are inside
// the collective waiting for it is declared dead after the heartbeat timeout; its group is
// aborted and every member fails naming it.
TEST(CollectiveTasksTest, AStuckWorkerFailsTheDynamicCollectiveNamingIt) {
  const int n = 3;
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(n)));
  ASSERT_OK_AND_ASSIGN(ClusterInfo info, cluster->Info());
  const WorkerInfo victim = info.workers[2];
  std::vector<ObjectRef> inputs;
  for (int r = 0; r < n; ++r) {
    ASSERT_OK_AND_ASSIGN(ObjectRef x, cluster->Put(RandomTensor({1 << 16}, 4)));
    inputs.push_back(x);
  }
  // Stopped before the members are dispatched: the scheduler still counts it alive (its
  // heartbeats stop only now), so all three go out together and ranks 0 and 1 wait for it.
  ::kill(victim.pid, SIGSTOP);
  std::vector<ObjectRef> outputs;
  for (int r = 0; r < n; ++r) {
    SubmitOptions options;
    options.pinned_worker = info.workers[static_cast<size_t>(r)].id;
    ASSERT_OK_AND_ASSIGN(
        auto y, cluster->Submit("all_reduce", {inputs[static_cast<size_t>(r)]},
                                Member(9, r, n).Set("reduce", std::string("sum")), options));
    outputs.push_back(y[0]);
  }
  Result<Tensor> rank0 = cluster->Get(outputs[0], 25'000);
  Result<Tensor> rank1 = cluster->Get(outputs[1], 25'000);
  ::kill(victim.pid, SIGKILL);
  for (const Result<Tensor>* result : {&rank0, &rank1}) {
    ASSERT_FALSE(result->ok());
    EXPECT_NE(result->status().message().find(victim.id.ToString()), std::string::npos)
        << result->status().ToString();
    EXPECT_NE(result->status().message().find("died"), std::string::npos)
        << result->status().ToString();
  }
  std::printf("rank 0 failed with: %s\n", rank0.status().ToString().c_str());
}

// SIGSTOPs `pid` and returns once the kernel says it is stopped: a signal takes effect when the
// process next runs, and a busy host may let it handle one more message first.
void StopProcess(int pid) {
  ::kill(pid, SIGSTOP);
  const std::string stat = "/proc/" + std::to_string(pid) + "/stat";
  for (int i = 0; i < 1000; ++i) {
    const std::string text = ReadFileText(stat);
    const size_t paren = text.rfind(')');
    if (paren != std::string::npos && text.compare(paren + 1, 3, " T ") == 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Who waits on what: a member's worker stopped (SIGSTOP) while the other waits for it in the
// collective. Before the heartbeat timeout (3 s) declares it dead, Cluster::Waits and
// `tessera status --waits` name the stopped worker and the collective.
TEST(CollectiveTasksTest, StatusWaitsNamesAStoppedMemberAndItsCollective) {
  const int n = 2;
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(n)));
  ASSERT_OK_AND_ASSIGN(ClusterInfo info, cluster->Info());
  const WorkerInfo waiter = info.workers[0];
  const WorkerInfo victim = info.workers[1];
  std::vector<ObjectRef> inputs;
  for (int r = 0; r < n; ++r) {
    ASSERT_OK_AND_ASSIGN(ObjectRef x, cluster->Put(RandomTensor({1 << 16}, 4)));
    inputs.push_back(x);
  }
  StopProcess(victim.pid);
  const Clock::time_point stopped = Clock::now();
  std::vector<ObjectRef> outputs;
  for (int r = 0; r < n; ++r) {
    SubmitOptions options;
    options.pinned_worker = info.workers[static_cast<size_t>(r)].id;
    ASSERT_OK_AND_ASSIGN(
        auto y, cluster->Submit("all_reduce", {inputs[static_cast<size_t>(r)]},
                                Member(11, r, n).Set("reduce", std::string("sum")), options));
    outputs.push_back(y[0]);
  }
  // The waiter's line, once the victim has been silent for two heartbeat intervals.
  std::string line;
  while (Clock::now() - stopped < std::chrono::milliseconds(2800)) {
    Result<std::vector<WorkerWait>> waits = cluster->Waits();
    ASSERT_TRUE(waits.ok()) << waits.status().ToString();
    for (const WorkerWait& wait : *waits) {
      if (wait.worker == waiter.id && !wait.blocked_on.empty() &&
          wait.blocked_on.front() == victim.id &&
          wait.text.find("has not answered") != std::string::npos) {
        line = FormatWait(wait);
      }
    }
    if (!line.empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::printf("Cluster::Waits: %s\n", line.c_str());
  EXPECT_NE(line.find("collective 11/all_reduce"), std::string::npos) << line;
  EXPECT_NE(line.find(victim.id.ToString()), std::string::npos) << line;
  EXPECT_NE(line.find("has not answered"), std::string::npos) << line;
  // The same through the command line, still within the heartbeat timeout.
  const ProcessResult cli =
      RunBinary("tessera", "status --waits --address " + cluster->address() + " --token-file " +
                               cluster->session_dir() + "/token");
  const auto cli_done = Clock::now() - stopped;
  std::printf("tessera status --waits (%lld ms after the stop):\n%s",
              static_cast<long long>(
                  std::chrono::duration_cast<std::chrono::milliseconds>(cli_done).count()),
              cli.output.c_str());
  EXPECT_EQ(cli.exit_code, 0) << cli.output;
  if (cli_done < std::chrono::milliseconds(3000)) {
    EXPECT_NE(cli.output.find("collective 11/all_reduce"), std::string::npos) << cli.output;
    EXPECT_NE(cli.output.find("for " + victim.id.ToString() + ", which has not answered"),
              std::string::npos)
        << cli.output;
  }
  ::kill(victim.pid, SIGKILL);
  // Nothing hangs: the collective fails naming the dead worker.
  Result<Tensor> rank0 = cluster->Get(outputs[0], 25'000);
  ASSERT_FALSE(rank0.ok());
  EXPECT_NE(rank0.status().message().find(victim.id.ToString()), std::string::npos)
      << rank0.status().ToString();
}

// The same for a registered graph whose group has formed already (the second instance): the
// waiter is inside the exchange, and its line names the stopped peer and the collective.
TEST(CollectiveTasksTest, StatusWaitsNamesAStoppedPeerOfAFormedGroup) {
  const int n = 2;
  const int64_t numel = 1000;
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(Local(n)));
  ASSERT_OK_AND_ASSIGN(ClusterInfo info, cluster->Info());
  const WorkerInfo waiter = info.workers[0];
  const WorkerInfo victim = info.workers[1];
  const CollectiveChain chain = BuildChain(n, numel, {waiter.id, victim.id});
  ASSERT_OK_AND_ASSIGN(GraphHandle handle, cluster->RegisterGraph(chain.graph));
  for (int instance = 0; instance < 2; ++instance) {
    std::map<ObjectId, ObjectRef> bound;
    for (int r = 0; r < n; ++r) {
      ASSERT_OK_AND_ASSIGN(bound[chain.inputs[static_cast<size_t>(r)]],
                           cluster->Put(RandomTensor({numel}, 4)));
    }
    Clock::time_point stopped;
    if (instance == 1) {
      StopProcess(victim.pid);
      stopped = Clock::now();
    }
    ASSERT_OK_AND_ASSIGN(auto outputs, cluster->RunGraph(handle, bound));
    if (instance == 0) {
      ASSERT_OK(cluster->Get(outputs.at(chain.broadcast[0]), 30'000).status());
      continue;
    }
    std::string line;
    while (line.empty() && Clock::now() - stopped < std::chrono::milliseconds(2800)) {
      ASSERT_OK_AND_ASSIGN(std::vector<WorkerWait> waits, cluster->Waits());
      for (const WorkerWait& wait : waits) {
        if (wait.worker == waiter.id && wait.blocked_on == std::vector<WorkerId>{victim.id} &&
            wait.text.find("has not answered") != std::string::npos) {
          line = FormatWait(wait);
        }
      }
      if (line.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    std::printf("Cluster::Waits: %s\n", line.c_str());
    EXPECT_NE(line.find("waits in collective 1/all_reduce (rank 0 of 2"), std::string::npos)
        << line;
    EXPECT_NE(line.find("for " + victim.id.ToString() + ", which has not answered"),
              std::string::npos)
        << line;
    ::kill(victim.pid, SIGKILL);
    Result<Tensor> reduced = cluster->Get(outputs.at(chain.reduced[0]), 25'000);
    ASSERT_FALSE(reduced.ok());
    EXPECT_NE(reduced.status().message().find(victim.id.ToString()), std::string::npos)
        << reduced.status().ToString();
  }
}

}  // namespace
}  // namespace tessera::testing
