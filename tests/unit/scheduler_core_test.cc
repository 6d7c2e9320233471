// The scheduler's state machine (scheduler_core_fixture.h): joining, running submitted tasks,
// failures and lineage rebuilds, heartbeats, status, and the dashboard's figures.
#include <cmath>
#include <limits>

#include "scheduler/dashboard_view.h"
#include "scheduler/job_metrics.h"
#include "unit/scheduler_core_fixture.h"

namespace tessera::testing {
namespace {

TEST_F(SchedulerCoreTest, AJoinWithoutTheTokenIsRefused) {
  const WorkerId intruder = Join(proto::Role::WORKER, "guess");
  auto refused = outbox_.Take(intruder, Body::REFUSED);
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_NE(
      rpc::ToString(BodyOf(refused[0]).getRefused().getMessage()).find("invalid cluster token"),
      std::string::npos);
  EXPECT_TRUE(outbox_.disconnected.contains(intruder));
  EXPECT_EQ(core_.alive_workers(), 0);
  EXPECT_FALSE(core_.Admitted(intruder));

  const WorkerId rude = core_.Accept();
  EXPECT_FALSE(core_.Admitted(rude)) << "pending until its Hello is accepted";
  Status skipped_hello =
      Deliver(rude, [](proto::Envelope::Builder e) { e.initBody().initHeartbeat(); });
  EXPECT_FALSE(skipped_hello.ok());
  EXPECT_TRUE(outbox_.disconnected.contains(rude));
  EXPECT_FALSE(core_.Admitted(rude));

  const WorkerId member = Join(proto::Role::DRIVER);
  EXPECT_TRUE(core_.Admitted(member));
  EXPECT_FALSE(core_.Admitted(WorkerId(999'999))) << "unknown";
}

TEST_F(SchedulerCoreTest, RunsATaskAndTellsTheWatchingDriver) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Put(driver, 1, 1, /*inline_data=*/true);
  Submit(driver, 10, 1, 2);
  Watch(driver, 2);
  auto parts = outbox_.Take(worker, Body::GRAPH_PART);
  ASSERT_EQ(parts.size(), 1u) << "the task's one-task graph, once";
  EXPECT_EQ(BodyOf(parts[0]).getGraphPart().getTasks().size(), 1u);
  auto dispatches = outbox_.Take(worker, Body::RUN_GRAPH);
  ASSERT_EQ(dispatches.size(), 1u);
  auto task = BodyOf(dispatches[0]).getRunGraph();
  EXPECT_EQ(task.getInstance(), 10u);
  graph_of_[10] = task.getGraphId();
  ASSERT_EQ(task.getTaskNames().size(), 1u);
  EXPECT_EQ(rpc::ToString(task.getTaskNames()[0]), "t10");
  ASSERT_EQ(task.getInlineInputs().size(), 1u) << "a small input travels with the task";
  EXPECT_EQ(task.getInputs().size(), 0u);

  Finish(worker, 10, 2);
  auto ready = outbox_.Take(driver, Body::OBJECTS_READY);
  ASSERT_EQ(ready.size(), 1u);
  auto state = BodyOf(ready[0]).getObjectsReady().getObjects()[0];
  EXPECT_EQ(state.getId(), 2u);
  EXPECT_FALSE(state.hasError());
  EXPECT_EQ(state.getSource().getHolder(), worker.value());
  EXPECT_EQ(rpc::ToString(state.getSource().getAddress()),
            "data-" + std::to_string(worker.value()));

  // Releasing the output frees it on the worker; the input (now unused) too once released.
  Release(driver, 2);
  auto frees = outbox_.Take(worker, Body::FREE_OBJECTS);
  ASSERT_EQ(frees.size(), 1u);
  EXPECT_EQ(BodyOf(frees[0]).getFreeObjects().getIds()[0], 2u);
  Release(driver, 1);
  EXPECT_EQ(core_.num_objects(), 0u);
  EXPECT_EQ(core_.num_tasks(), 0u);
}

// A small output a worker sealed (its bytes in the report) and holds, read by the next task there:
// the RunGraph carries its bytes and binds it to that worker too, which then reads its own copy
// rather than make another from the bytes (a step's small state, every step). A driver's small
// Put, which no worker holds, travels as bytes only.
TEST_F(SchedulerCoreTest, ASmallObjectAWorkerHoldsIsBoundToItBesidesItsBytes) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Put(driver, 1, 1, /*inline_data=*/true);
  Submit(driver, 10, 1, 2);
  auto first = outbox_.Take(worker, Body::RUN_GRAPH);
  ASSERT_EQ(first.size(), 1u);
  graph_of_[10] = BodyOf(first[0]).getRunGraph().getGraphId();
  EXPECT_EQ(BodyOf(first[0]).getRunGraph().getInlineInputs().size(), 1u);
  EXPECT_EQ(BodyOf(first[0]).getRunGraph().getInputs().size(), 0u);
  ASSERT_OK(Deliver(worker, [&](proto::Envelope::Builder e) {
    auto finished = e.initBody().initInstanceFinished();
    finished.setGraphId(graph_of_[10]);
    finished.setInstance(10);
    auto sealed = finished.initOutputs(1)[0];
    sealed.setId(2);
    sealed.setBytes(4);
    sealed.setInline(capnp::Data::Reader(reinterpret_cast<const kj::byte*>("wxyz"), 4));
  }));
  Submit(driver, 11, 2, 3);
  auto second = outbox_.Take(worker, Body::RUN_GRAPH);
  ASSERT_EQ(second.size(), 1u);
  auto run = BodyOf(second[0]).getRunGraph();
  ASSERT_EQ(run.getInlineInputs().size(), 1u);
  ASSERT_EQ(run.getInputs().size(), 1u);
  EXPECT_EQ(run.getInputs()[0].getObject(), run.getInlineInputs()[0].getId());
  EXPECT_EQ(run.getInputs()[0].getSource().getObject(), 2u);
  EXPECT_EQ(run.getInputs()[0].getSource().getHolder(), worker.value());
}

TEST_F(SchedulerCoreTest, TasksGoWhereTheirInputsAre) {
  const WorkerId w1 = Join(proto::Role::WORKER);
  const WorkerId w2 = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Put(driver, 1, 1, true);
  Submit(driver, 10, 1, 2, /*numel=*/1 << 20);  // big output
  const WorkerId first = Dispatched(w1).empty() ? w2 : w1;
  Dispatched(w2);
  Finish(first, 10, 2, 4 << 20);
  for (uint64_t t = 11; t < 15; ++t) Submit(driver, t, 2, 100 + t);
  const WorkerId other = first == w1 ? w2 : w1;
  EXPECT_EQ(Dispatched(first).size(), 4u) << "every reader of the 4 MiB object runs where it is";
  EXPECT_TRUE(Dispatched(other).empty());
}

TEST_F(SchedulerCoreTest, ADependentTaskWaitsForItsInput) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Put(driver, 1, 1, true);
  Submit(driver, 10, 1, 2);
  Submit(driver, 11, 2, 3);
  EXPECT_EQ(Dispatched(worker), (std::vector<uint64_t>{10}));
  Finish(worker, 10, 2);
  EXPECT_EQ(Dispatched(worker), (std::vector<uint64_t>{11}));
}

TEST_F(SchedulerCoreTest, ADeadWorkersTaskIsRetriedWhenItsInputsSurvive) {
  const WorkerId w1 = Join(proto::Role::WORKER);
  const WorkerId w2 = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Put(driver, 1, 1 << 20, /*inline_data=*/false);  // held by the driver
  Submit(driver, 10, 1, 2);
  const WorkerId victim = Dispatched(w1).empty() ? w2 : w1;
  const WorkerId survivor = victim == w1 ? w2 : w1;
  Dispatched(w2);
  core_.Disconnected(victim, Unavailable("connection reset"));
  core_.Flush();
  EXPECT_EQ(Dispatched(survivor), (std::vector<uint64_t>{10}));
  EXPECT_EQ(core_.alive_workers(), 1);
}

TEST_F(SchedulerCoreTest, ObjectsLostWithAWorkerFailEverythingThatNeedsThem) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Put(driver, 1, 1, true);
  Submit(driver, 10, 1, 2, 1 << 20);
  Finish(worker, 10, 2, 4 << 20);
  Submit(driver, 11, 2, 3);  // dispatched to the worker, which then dies
  Watch(driver, 2);
  Watch(driver, 3);
  outbox_.Take(driver, Body::OBJECTS_READY);  // 2 was already ready
  core_.Disconnected(worker, Unavailable("connection reset"));
  core_.Flush();
  auto ready = outbox_.Take(driver, Body::OBJECTS_READY);
  ASSERT_EQ(ready.size(), 1u);
  auto objects = BodyOf(ready[0]).getObjectsReady().getObjects();
  ASSERT_EQ(objects.size(), 1u);
  EXPECT_EQ(objects[0].getId(), 3u);
  ASSERT_TRUE(objects[0].hasError());
  const std::string message = rpc::ToString(objects[0].getError().getMessage());
  EXPECT_NE(message.find("t11"), std::string::npos) << message;
  EXPECT_NE(message.find(worker.ToString()), std::string::npos) << message;
  EXPECT_NE(message.find("lost inputs: o2"), std::string::npos) << message;
  // Asking for the lost object itself also gives the reason.
  Watch(driver, 2);
  auto lost = outbox_.Take(driver, Body::OBJECTS_READY);
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_NE(rpc::ToString(BodyOf(lost[0]).getObjectsReady().getObjects()[0].getError().getMessage())
                .find("only copy was on"),
            std::string::npos);
}

// A chain put -> t10 -> o2 -> t11 -> o3 -> t12 -> o4 ran on w1; the driver keeps only o4, so o2
// and o3 were freed. w1 dies with o4: the chain runs again on w2 from the put, one task after
// the other, and the driver gets o4 from w2.
TEST_F(SchedulerCoreTest, ALostObjectIsRebuiltFromItsLineageThroughFreedInputs) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Put(driver, 1, 1 << 20, /*inline_data=*/false);
  for (uint64_t t = 10; t <= 12; ++t) {
    Submit(driver, t, t - 9, t - 8, 1 << 20);
    core_.Flush();
    ASSERT_EQ(Dispatched(w1), (std::vector<uint64_t>{t}));
    Finish(w1, t, t - 8, 4 << 20);
  }
  Release(driver, 2);
  Release(driver, 3);
  EXPECT_EQ(core_.num_objects(), 2u);  // the put and o4
  core_.Disconnected(w1, Unavailable("killed"));
  for (uint64_t t = 10; t <= 12; ++t) {
    core_.Flush();
    ASSERT_EQ(Dispatched(w2), (std::vector<uint64_t>{t})) << "task t" << t << " runs again";
    Finish(w2, t, t - 8, 4 << 20);
  }
  Watch(driver, 4);
  core_.Flush();
  auto ready = outbox_.Take(driver, Body::OBJECTS_READY);
  ASSERT_EQ(ready.size(), 1u);
  auto object = BodyOf(ready[0]).getObjectsReady().getObjects()[0];
  ASSERT_FALSE(object.hasError()) << rpc::ToString(object.getError().getMessage());
  EXPECT_EQ(object.getSource().getHolder(), w2.value());
  EXPECT_EQ(core_.num_objects(), 2u) << "the rebuilt intermediates are freed again";
}

// Each task runs again at most max_task_attempts (3) times; then the lost object fails, saying so.
TEST_F(SchedulerCoreTest, RebuildingStopsAtTheBudget) {
  const WorkerId driver = Join(proto::Role::DRIVER);
  WorkerId holder = Join(proto::Role::WORKER);
  Put(driver, 1, 1 << 20, /*inline_data=*/false);
  Submit(driver, 10, 1, 2, 1 << 20);
  core_.Flush();
  ASSERT_EQ(Dispatched(holder), (std::vector<uint64_t>{10}));
  Finish(holder, 10, 2, 4 << 20);
  for (int rebuilds = 1; rebuilds <= 3; ++rebuilds) {
    const WorkerId next = Join(proto::Role::WORKER);
    core_.Disconnected(holder, Unavailable("killed"));
    core_.Flush();
    ASSERT_EQ(Dispatched(next), (std::vector<uint64_t>{10})) << "rebuild " << rebuilds;
    Finish(next, 10, 2, 4 << 20);
    holder = next;
  }
  Join(proto::Role::WORKER);
  core_.Disconnected(holder, Unavailable("killed"));
  Watch(driver, 2);
  const std::string error = ReadyError(driver);
  EXPECT_NE(error.find("only copy was on"), std::string::npos) << error;
  EXPECT_NE(error.find("its task 't10' was run again 3 times already"), std::string::npos) << error;
}

TEST_F(SchedulerCoreTest, ATaskOnAFailedInputFailsWithoutDisturbingOtherReaders) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Put(driver, 1, 1, true);
  Submit(driver, 10, 1, 2);  // dispatched
  ASSERT_EQ(Dispatched(worker), (std::vector<uint64_t>{10}));
  FinishWithError(worker, 10, InvalidArgument("kernel refused"));
  Submit(driver, 11, 2, 3);  // reads the failed object: fails at once
  Watch(driver, 3);
  auto ready = outbox_.Take(driver, Body::OBJECTS_READY);
  ASSERT_EQ(ready.size(), 1u);
  EXPECT_NE(
      rpc::ToString(BodyOf(ready[0]).getObjectsReady().getObjects()[0].getError().getMessage())
          .find("kernel refused"),
      std::string::npos);
  // Everything is released cleanly: no dangling uses keep objects alive.
  Release(driver, 2);
  Release(driver, 3);
  Release(driver, 1);
  EXPECT_EQ(core_.num_objects(), 0u);
  EXPECT_EQ(core_.num_tasks(), 0u);
}

TEST_F(SchedulerCoreTest, MissedHeartbeatsDeclareAWorkerDead) {
  const WorkerId worker = Join(proto::Role::WORKER);
  now_ += std::chrono::milliseconds(2000);
  ASSERT_OK(Deliver(worker, [](proto::Envelope::Builder e) { e.initBody().initHeartbeat(); }));
  now_ += std::chrono::milliseconds(2500);
  core_.Tick();
  core_.Flush();
  EXPECT_EQ(core_.alive_workers(), 1);
  now_ += std::chrono::milliseconds(1000);
  core_.Tick();
  core_.Flush();
  EXPECT_EQ(core_.alive_workers(), 0);
  ASSERT_TRUE(outbox_.disconnected.contains(worker));
  EXPECT_NE(outbox_.disconnected[worker].message().find("no heartbeat"), std::string::npos);
}

// Workers and drivers take a scheduler silent past their limit for gone (a stopped process closes
// no connection): every heartbeat interval each alive participant gets at least a keepalive.
TEST_F(SchedulerCoreTest, EveryParticipantHearsFromTheSchedulerEachHeartbeatInterval) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  const WorkerId dead = Join(proto::Role::WORKER);
  core_.Disconnected(dead, Unavailable("gone"));
  for (int interval = 1; interval <= 3; ++interval) {
    now_ += std::chrono::milliseconds(500);  // the default heartbeat interval
    ASSERT_OK(Deliver(worker, [](proto::Envelope::Builder e) { e.initBody().initHeartbeat(); }));
    core_.Tick();
    core_.Flush();
    EXPECT_EQ(outbox_.Take(worker, Body::KEEPALIVE).size(), 1u) << "interval " << interval;
    EXPECT_EQ(outbox_.Take(driver, Body::KEEPALIVE).size(), 1u) << "interval " << interval;
    EXPECT_TRUE(outbox_.Take(dead, Body::KEEPALIVE).empty());
  }
  // More ticks within one interval send nothing more.
  core_.Tick();
  core_.Flush();
  EXPECT_TRUE(outbox_.Take(worker, Body::KEEPALIVE).empty());
}

TEST_F(SchedulerCoreTest, UnknownInputsAndWrongRolesAreReported) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Submit(driver, 10, /*input=*/999, 2);
  Watch(driver, 2);
  auto ready = outbox_.Take(driver, Body::OBJECTS_READY);
  ASSERT_EQ(ready.size(), 1u);
  const std::string message =
      rpc::ToString(BodyOf(ready[0]).getObjectsReady().getObjects()[0].getError().getMessage());
  EXPECT_NE(message.find("obj999"), std::string::npos) << message;
  EXPECT_TRUE(Dispatched(worker).empty());

  // A worker may not submit tasks; a driver may not report results.
  EXPECT_FALSE(
      Deliver(worker, [](proto::Envelope::Builder e) { e.initBody().initSubmitTasks(); }).ok());
  EXPECT_FALSE(Deliver(driver, [](proto::Envelope::Builder e) {
                 e.initBody().initInstanceFinished();
               }).ok());
  // A result for an instance the worker is not running is ignored, not fatal.
  EXPECT_OK(Deliver(worker, [](proto::Envelope::Builder e) {
    auto finished = e.initBody().initInstanceFinished();
    finished.setGraphId(kFirstSchedulerGraphId + 77);
    finished.setInstance(12345);
  }));
}

TEST_F(SchedulerCoreTest, StatusDescribesWorkersAndTasks) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId admin = Join(proto::Role::ADMIN);
  ASSERT_OK(Deliver(admin, [](proto::Envelope::Builder e) {
    e.setRequestId(5);
    e.initBody().initStatusRequest();
  }));
  auto replies = outbox_.Take(admin, Body::STATUS_REPLY);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0]->reader().getRoot<proto::Envelope>().getRequestId(), 5u);
  auto status = BodyOf(replies[0]).getStatusReply();
  ASSERT_EQ(status.getWorkers().size(), 1u);
  EXPECT_EQ(status.getWorkers()[0].getId(), worker.value());
  EXPECT_TRUE(status.getWorkers()[0].getAlive());
  EXPECT_EQ(status.getWorkers()[0].getHeartbeat().getHostCapacity(), 1 << 30);
  EXPECT_EQ(rpc::ToString(status.getSessionDir()), "/tmp/s");
}

// A worker's heartbeat figures reach status and the dashboard (CPU, the store); nonsense off the
// wire (a negative count, a NaN) counts as nothing. A worker whose connection goes is kept,
// dead, with its last figures.
TEST_F(SchedulerCoreTest, HeartbeatFiguresAreShownAndADepartedWorkerStaysListedDead) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId other = Join(proto::Role::WORKER);
  ASSERT_OK(Deliver(worker, [](proto::Envelope::Builder e) {
    auto heartbeat = e.initBody().initHeartbeat();
    heartbeat.setCpuSeconds(12.5);
    heartbeat.setCpuUtilization(0.75f);
    heartbeat.setObjects(42);
    heartbeat.setDeviceBytes(1 << 20);
    heartbeat.setRestores(3);
    auto gpu = heartbeat.initGpu();
    gpu.setUtilization(0.5f);
    gpu.setMemoryUsed(int64_t{2} << 30);
    gpu.setMemoryTotal(int64_t{80} << 30);
  }));
  ASSERT_OK(Deliver(other, [](proto::Envelope::Builder e) {
    auto heartbeat = e.initBody().initHeartbeat();
    heartbeat.setCpuSeconds(std::numeric_limits<double>::quiet_NaN());
    heartbeat.setCpuUtilization(-1.0f);
    heartbeat.setObjects(-5);
    heartbeat.setRestores(-1);
    auto gpu = heartbeat.initGpu();  // a utilisation past 1 and more memory used than there is
    gpu.setUtilization(7.0f);
    gpu.setMemoryUsed(int64_t{9} << 30);
    gpu.setMemoryTotal(int64_t{8} << 30);
  }));
  CoreDashboardSource source(&core_, now_, [this] { return now_; });
  dashboard::ClusterView view = source.Cluster();
  ASSERT_EQ(view.workers.size(), 2u);
  EXPECT_DOUBLE_EQ(view.workers[0].cpu_seconds, 12.5);
  EXPECT_DOUBLE_EQ(view.workers[0].cpu_utilization, 0.75);
  EXPECT_EQ(view.workers[0].objects, 42);
  EXPECT_EQ(view.workers[0].device_bytes, 1 << 20);
  EXPECT_EQ(view.workers[0].restores, 3);
  EXPECT_EQ(view.workers[1].cpu_seconds, 0);
  EXPECT_EQ(view.workers[1].cpu_utilization, 0);
  EXPECT_EQ(view.workers[1].objects, 0);
  EXPECT_EQ(view.workers[1].restores, 0);
  ASSERT_TRUE(view.workers[0].gpu_use.has_value());
  EXPECT_DOUBLE_EQ(view.workers[0].gpu_use->utilization, 0.5);
  EXPECT_EQ(view.workers[0].gpu_use->memory_used, int64_t{2} << 30);
  EXPECT_EQ(view.workers[0].gpu_use->memory_total, int64_t{80} << 30);
  ASSERT_TRUE(view.workers[1].gpu_use.has_value());
  EXPECT_DOUBLE_EQ(view.workers[1].gpu_use->utilization, 1.0);
  EXPECT_EQ(view.workers[1].gpu_use->memory_used, int64_t{8} << 30);
  // A heartbeat without GPU figures clears the last ones (they would be stale).
  ASSERT_OK(Deliver(other, [](proto::Envelope::Builder e) { e.initBody().initHeartbeat(); }));
  EXPECT_FALSE(source.Cluster().workers[1].gpu_use.has_value());

  core_.Disconnected(worker, Unavailable("connection reset"));
  const WorkerId admin = Join(proto::Role::ADMIN);
  ASSERT_OK(Deliver(admin, [](proto::Envelope::Builder e) { e.initBody().initStatusRequest(); }));
  auto replies = outbox_.Take(admin, Body::STATUS_REPLY);
  ASSERT_EQ(replies.size(), 1u);
  auto workers = BodyOf(replies[0]).getStatusReply().getWorkers();
  ASSERT_EQ(workers.size(), 2u);  // the live one first, then the departed one
  EXPECT_EQ(workers[0].getId(), other.value());
  EXPECT_TRUE(workers[0].getAlive());
  EXPECT_EQ(workers[1].getId(), worker.value());
  EXPECT_FALSE(workers[1].getAlive());
  EXPECT_EQ(workers[1].getHeartbeat().getObjects(), 42);
  EXPECT_DOUBLE_EQ(workers[1].getHeartbeat().getCpuSeconds(), 12.5);
  ASSERT_TRUE(workers[1].getHeartbeat().hasGpu());  // what `tessera status` prints
  EXPECT_FLOAT_EQ(workers[1].getHeartbeat().getGpu().getUtilization(), 0.5f);
  EXPECT_EQ(workers[1].getHeartbeat().getGpu().getMemoryTotal(), int64_t{80} << 30);
  EXPECT_FALSE(workers[0].getHeartbeat().hasGpu());
  view = source.Cluster();
  ASSERT_EQ(view.workers.size(), 2u);
  EXPECT_FALSE(view.workers[1].alive);
  EXPECT_EQ(view.workers[1].id, worker.value());
  EXPECT_EQ(core_.alive_workers(), 1);
}

// The departed are bounded: the oldest go first.
TEST(ParticipantTableTest, DepartedWorkersAreBounded) {
  ParticipantTable table("t", "/tmp/s");
  const auto now = std::chrono::steady_clock::now();
  std::vector<WorkerId> ids;
  for (size_t i = 0; i < ParticipantTable::kDepartedKept + 3; ++i) {
    const WorkerId id = table.Accept(now);
    table.Find(id)->role = ParticipantRole::kWorker;
    ids.push_back(id);
    table.Remove(id);
  }
  const WorkerId pending = table.Accept(now);  // never said hello: not a worker, not kept
  table.Remove(pending);
  ASSERT_EQ(table.departed().size(), ParticipantTable::kDepartedKept);
  EXPECT_EQ(table.departed().front().id, ids[3]);
  EXPECT_EQ(table.departed().back().id, ids.back());
  EXPECT_FALSE(table.departed().back().alive);
  EXPECT_TRUE(table.all().empty());
}

// ---- the dashboard's figures: job progress and the timeline ----

TEST_F(SchedulerCoreTest, DriverProgressIsKeptForTheDashboardAndAWorkersIsRefused) {
  const Cluster c = JoinTwoWorkersAndADriver();
  for (int64_t step = 1; step <= 3; ++step) {
    EXPECT_OK(Deliver(c.driver, [&](proto::Envelope::Builder e) {
      auto progress = e.initBody().initJobProgress();
      progress.setJob("train_gpt2");
      progress.setStep(step);
      progress.setLoss(5.0 - static_cast<double>(step));
      progress.setStepMs(20);
      progress.setTokensPerSecond(1000);
      progress.setSamplesPerSecond(std::numeric_limits<double>::quiet_NaN());
      if (step == 1) progress.setPlan("data_parallel=2 zero_stage=2");  // sent when new
      if (step == 2) progress.setValidationLoss(3.25);                  // an evaluated step
    }));
  }
  Status refused = Deliver(c.w1, [](proto::Envelope::Builder e) {
    e.initBody().initJobProgress().setJob("not a driver");
  });
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();

  CoreDashboardSource source(&core_, now_, [this] { return now_; });
  const std::vector<dashboard::JobView> jobs = source.Jobs();
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].name, "train_gpt2");
  EXPECT_EQ(jobs[0].driver, c.driver.value());
  EXPECT_TRUE(jobs[0].connected);
  ASSERT_EQ(jobs[0].points.size(), 3u);
  EXPECT_EQ(jobs[0].points[2].step, 3);
  EXPECT_DOUBLE_EQ(jobs[0].points[2].loss, 2.0);
  EXPECT_TRUE(std::isnan(jobs[0].points[2].samples_per_second));
  // The plan is kept from the step that sent it; a validation loss only where one was evaluated
  // (a report without the field reads NaN, its default).
  EXPECT_EQ(jobs[0].plan, "data_parallel=2 zero_stage=2");
  EXPECT_DOUBLE_EQ(jobs[0].points[1].validation_loss, 3.25);
  EXPECT_TRUE(std::isnan(jobs[0].points[0].validation_loss));
  EXPECT_TRUE(std::isnan(jobs[0].points[2].validation_loss));

  const dashboard::ClusterView cluster = source.Cluster();
  EXPECT_EQ(cluster.workers.size(), 2u);
  EXPECT_EQ(cluster.drivers, 1);
  EXPECT_EQ(cluster.session_dir, "/tmp/s");

  core_.Disconnected(c.driver, Cancelled("done"));
  EXPECT_FALSE(source.Jobs()[0].connected);  // the history stays, marked finished
}

TEST(JobMetricsTest, HistoryIsBoundedAndCountsWhatItDropped) {
  JobMetrics metrics;
  capnp::MallocMessageBuilder message;
  auto progress = message.initRoot<proto::JobProgress>();
  progress.setJob("job");
  const auto now = std::chrono::steady_clock::now();
  for (size_t step = 1; step <= JobMetrics::kMaxPoints + 5; ++step) {
    progress.setStep(static_cast<int64_t>(step));
    progress.setStepMs(step % 2 == 0 ? 3000 : 0);  // every other step without a time
    metrics.Record(WorkerId(7), progress.asReader(), now);
  }
  ASSERT_EQ(metrics.jobs().size(), 1u);
  EXPECT_EQ(metrics.jobs()[0].steps.size(), JobMetrics::kMaxPoints);
  EXPECT_EQ(metrics.jobs()[0].dropped, 5);
  EXPECT_EQ(metrics.jobs()[0].steps.front().step, 6);
  // The step counter and the step-time histogram count every step, dropped points included.
  const int64_t reported = static_cast<int64_t>(JobMetrics::kMaxPoints) + 5;
  const dashboard::StepTimeHistogram& times = metrics.jobs()[0].step_times;
  const int64_t timed = reported / 2;  // the even steps
  EXPECT_EQ(metrics.jobs()[0].reported, reported);
  EXPECT_EQ(times.count, timed);
  EXPECT_DOUBLE_EQ(times.sum_s, 3.0 * static_cast<double>(timed));
  EXPECT_EQ(times.counts[9], timed);  // the bucket (2.5 s, 5 s]
  for (size_t job = 0; job < JobMetrics::kMaxJobs + 2; ++job) {
    metrics.Record(WorkerId(100 + job), progress.asReader(), now);
  }
  EXPECT_EQ(metrics.jobs().size(), JobMetrics::kMaxJobs);
}

}  // namespace
}  // namespace tessera::testing
