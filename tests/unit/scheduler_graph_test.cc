// The scheduler's registered graphs (scheduler_core_fixture.h): placement, refusals, instances
// and their failures, collective members inside graphs.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>

#include "core/collective_task.h"
#include "unit/scheduler_core_fixture.h"
#include "unit/scheduler_test_graphs.h"

namespace tessera::testing {
namespace {

class RegisteredGraphTest : public SchedulerCoreTest {
 protected:
  // Sends RegisterGraph as the driver library does; returns the protocol status.
  Status Register(WorkerId driver, uint64_t graph_id, const Graph& graph, uint64_t request_id = 7) {
    return Deliver(driver, [&](proto::Envelope::Builder e) {
      e.setRequestId(request_id);
      RegisterGraphToWire(graph, graph_id, e.initBody().initRegisterGraph());
    });
  }

  // The one Reply the driver got (its error, OK when none).
  Status TakeReply(WorkerId driver, uint64_t request_id = 7) {
    auto replies = outbox_.Take(driver, Body::REPLY);
    if (replies.size() != 1) return Internal("{} replies", replies.size());
    EXPECT_EQ(replies[0]->reader().getRoot<proto::Envelope>().getRequestId(), request_id);
    auto reply = BodyOf(replies[0]).getReply();
    return reply.hasMessage() || reply.getCode() != 0 ? rpc::FromWire(reply) : Status::Ok();
  }

  // A graph of one task on `worker` making a large object (1000 floats) from its one input, a
  // scalar (`*input`).
  static Graph MakerOn(WorkerId worker, ObjectId* input) {
    Graph graph;
    *input = graph.AddObject("x", Floats(1), ObjectRole::kInput);
    graph.MarkOutput(AddGelu(graph, "make", {*input}, 1000, worker));
    return graph;
  }

  // Registers each graph under its id (request ids 7, 8, ...), each accepted.
  void RegisterEach(WorkerId driver, const std::vector<std::pair<uint64_t, const Graph*>>& graphs) {
    uint64_t request_id = 7;
    for (const auto& [graph_id, graph] : graphs) {
      ASSERT_OK(Register(driver, graph_id, *graph, request_id));
      EXPECT_OK(TakeReply(driver, request_id++));
    }
  }

  // The task workers of the one GraphPart sent to `worker` (empty when none).
  std::vector<uint64_t> PartOn(WorkerId worker) {
    auto parts = outbox_.Take(worker, Body::GRAPH_PART);
    if (parts.size() != 1) return {};
    std::vector<uint64_t> task_workers;
    for (uint64_t w : BodyOf(parts[0]).getGraphPart().getTaskWorkers()) task_workers.push_back(w);
    return task_workers;
  }

  // `take_over`: the driver hands every bound object over with the run (RunGraph's takeOver).
  Status Run(WorkerId driver, uint64_t graph_id, uint64_t instance,
             const std::vector<std::pair<uint64_t, uint64_t>>& bindings,
             const std::vector<uint64_t>& output_ids, bool take_over = false) {
    return Deliver(driver, [&](proto::Envelope::Builder e) {
      auto run = e.initBody().initRunGraph();
      run.setGraphId(graph_id);
      run.setInstance(instance);
      auto inputs = run.initInputs(static_cast<unsigned>(bindings.size()));
      for (unsigned i = 0; i < bindings.size(); ++i) {
        inputs[i].setObject(bindings[i].first);
        inputs[i].initSource().setObject(bindings[i].second);
        inputs[i].setTakeOver(take_over);
      }
      auto ids = run.initOutputIds(static_cast<unsigned>(output_ids.size()));
      for (unsigned i = 0; i < output_ids.size(); ++i) ids.set(i, output_ids[i]);
    });
  }

  // `worker` finished its part of the instance, sealing `sealed` (or failed with `error`,
  // putting back `restored`).
  Status InstanceDone(WorkerId worker, uint64_t graph_id, uint64_t instance,
                      const std::vector<uint64_t>& sealed, const Status& error = Status::Ok(),
                      const std::vector<uint64_t>& restored = {}) {
    return Deliver(worker, [&](proto::Envelope::Builder e) {
      auto done = e.initBody().initInstanceFinished();
      done.setGraphId(graph_id);
      done.setInstance(instance);
      if (!error.ok()) rpc::ToWire(error, done.initError());
      auto put_back = done.initRestored(static_cast<unsigned>(restored.size()));
      for (unsigned i = 0; i < restored.size(); ++i) put_back.set(i, restored[i]);
      auto outputs = done.initOutputs(static_cast<unsigned>(sealed.size()));
      for (unsigned i = 0; i < sealed.size(); ++i) {
        outputs[i].setId(sealed[i]);
        outputs[i].setBytes(4);
      }
    });
  }
};

TEST_F(RegisteredGraphTest, TasksGoBesideTheirLargestProducedInputElseToTheLeastLoaded) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  const ObjectId a_out = AddGelu(graph, "a", {x}, /*out_numel=*/100);  // least loaded: w1
  const ObjectId b_out = AddGelu(graph, "b", {x}, /*out_numel=*/10);   // least loaded: w2
  AddGelu(graph, "c", {b_out, a_out});                                 // beside a (the larger): w1
  AddGelu(graph, "d", {a_out}, 1, /*pinned=*/w2);                      // pinned: w2
  graph.MarkOutput(AddGelu(graph, "e", {b_out}));                      // beside b: w2
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  const std::vector<uint64_t> expected = {w1.value(), w2.value(), w1.value(), w2.value(),
                                          w2.value()};
  EXPECT_EQ(PartOn(w1), expected);
  EXPECT_EQ(PartOn(w2), expected);

  // An instance: its input bound to a Put, its output sealed where it was produced.
  Put(driver, 1, 1, /*inline_data=*/true);
  ASSERT_OK(Run(driver, 3, 1, {{x.value(), 1}}, {50}));
  for (WorkerId worker : {w1, w2}) {
    auto runs = outbox_.Take(worker, Body::RUN_GRAPH);
    ASSERT_EQ(runs.size(), 1u);
    auto run = BodyOf(runs[0]).getRunGraph();
    EXPECT_EQ(run.getInstance(), 1u);
    ASSERT_EQ(run.getInlineInputs().size(), 1u);
    EXPECT_EQ(run.getInlineInputs()[0].getId(), x.value());
    EXPECT_EQ(run.getOutputIds()[0], 50u);
  }
  Watch(driver, 50);
  EXPECT_TRUE(outbox_.Take(driver, Body::OBJECTS_READY).empty());
  ASSERT_OK(InstanceDone(w1, 3, 1, {}));
  ASSERT_OK(InstanceDone(w2, 3, 1, {50}));
  EXPECT_EQ(ReadyError(driver), "");
  Release(driver, 50);
  Release(driver, 1);
  EXPECT_EQ(core_.num_objects(), 0u);
}

// A driver hands a run the objects it binds (a trainer's state): its references go with the
// run. The one worker holding such an object, when it alone reads it and nothing else uses it,
// is told to take it over (move it out of its store, so the run may update it in place); an
// object another worker reads too (it pulls from the holder), or that something else still
// uses (a run in flight), is read as any other. Either way it is freed once the run ends, without
// a Release; a refused run takes the reference too.
TEST_F(RegisteredGraphTest, AnObjectHandedToARunIsTakenOverByItsOnlyHolderAndReader) {
  const Cluster joined = JoinTwoWorkersAndADriver();
  const WorkerId w1 = joined.w1, w2 = joined.w2, driver = joined.driver;
  // Graph 3 makes a large object on w1; graph 4 reads its input on w1 alone, graph 5 on both.
  ObjectId x;
  const Graph make = MakerOn(w1, &x);
  Graph read_here, read_both;
  const ObjectId in4 = read_here.AddObject("in", Floats(1000), ObjectRole::kInput);
  read_here.MarkOutput(AddGelu(read_here, "update", {in4}, 1000, w1));
  const ObjectId in5 = read_both.AddObject("in", Floats(1000), ObjectRole::kInput);
  read_both.MarkOutput(AddGelu(read_both, "a", {in5}, 1, w1));
  read_both.MarkOutput(AddGelu(read_both, "b", {in5}, 1, w2));
  RegisterEach(driver, {{3, &make}, {4, &read_here}, {5, &read_both}});
  outbox_.Take(w1, Body::GRAPH_PART);
  outbox_.Take(w2, Body::GRAPH_PART);
  Put(driver, 1, 1, /*inline_data=*/true);
  const auto made_on_w1 = [&](uint64_t instance, uint64_t id) {
    ASSERT_OK(Run(driver, 3, instance, {{x.value(), 1}}, {id}));
    ASSERT_OK(InstanceDone(w1, 3, instance, {id}));
    outbox_.Take(w1, Body::RUN_GRAPH);
  };
  const auto take_over_flags = [&](WorkerId worker) {
    std::vector<bool> flags;
    for (const auto& message : outbox_.Take(worker, Body::RUN_GRAPH)) {
      for (auto binding : BodyOf(message).getRunGraph().getInputs()) {
        flags.push_back(binding.getTakeOver());
      }
    }
    return flags;
  };

  // Held and read on w1 alone: taken over there.
  made_on_w1(1, 50);
  const size_t objects = core_.num_objects();
  ASSERT_OK(Run(driver, 4, 1, {{in4.value(), 50}}, {60}, /*take_over=*/true));
  EXPECT_EQ(take_over_flags(w1), std::vector<bool>{true});
  ASSERT_OK(InstanceDone(w1, 4, 1, {60}));
  EXPECT_EQ(core_.num_objects(), objects);  // 50 freed with the run (no Release), 60 made
  outbox_.Take(w1, Body::FREE_OBJECTS);

  // Read on both workers (w2 pulls it from w1): read as any other, freed after the run.
  made_on_w1(2, 51);
  ASSERT_OK(Run(driver, 5, 1, {{in5.value(), 51}}, {70, 71}, /*take_over=*/true));
  EXPECT_EQ(take_over_flags(w1), std::vector<bool>{false});
  EXPECT_EQ(take_over_flags(w2), std::vector<bool>{false});
  ASSERT_OK(InstanceDone(w1, 5, 1, {70}));
  ASSERT_OK(InstanceDone(w2, 5, 1, {71}));
  EXPECT_EQ(core_.num_objects(), objects + 2);  // 51 freed; 70 and 71 made

  // Still read by a run in flight: read as any other.
  made_on_w1(3, 52);
  ASSERT_OK(Run(driver, 4, 2, {{in4.value(), 52}}, {61}));
  ASSERT_OK(Run(driver, 4, 3, {{in4.value(), 52}}, {63}, /*take_over=*/true));
  EXPECT_EQ(take_over_flags(w1), (std::vector<bool>{false, false}));
  ASSERT_OK(InstanceDone(w1, 4, 2, {61}));
  ASSERT_OK(InstanceDone(w1, 4, 3, {63}));

  // A run refused (bound to an object not made yet) still takes the driver's reference.
  ASSERT_OK(Run(driver, 3, 4, {{x.value(), 1}}, {53}));
  outbox_.Take(w1, Body::RUN_GRAPH);
  ASSERT_OK(Run(driver, 4, 4, {{in4.value(), 53}}, {62}, /*take_over=*/true));
  EXPECT_TRUE(take_over_flags(w1).empty());
  Watch(driver, 62);
  EXPECT_THAT(ReadyError(driver), ::testing::HasSubstr("not ready"));
  ASSERT_OK(InstanceDone(w1, 3, 4, {53}));
  for (uint64_t id : {60, 70, 71, 61, 63, 62, 1}) Release(driver, id);
  EXPECT_EQ(core_.num_objects(), 0u);
}

// A failed run whose workers took over handed-over objects ends once each of those workers has
// said which it put back unchanged: those are the driver's again (a HandedBack, sent before the
// outputs fail; the driver releases them as any other), the rest are lost. A worker putting back
// what it was not told to take over breaks the protocol; one that dies loses what it took.
TEST_F(RegisteredGraphTest, AFailedRunHandsBackWhatItsWorkersPutBack) {
  const Cluster joined = JoinTwoWorkersAndADriver();
  const WorkerId w1 = joined.w1, w2 = joined.w2, driver = joined.driver;
  // Graphs 3 and 4 make a large object on w1 and on w2; graph 6 reads one on each (each its
  // holder's only reader, so each is taken over there).
  ObjectId x1, x2;
  const Graph make1 = MakerOn(w1, &x1), make2 = MakerOn(w2, &x2);
  Graph update;
  const ObjectId a = update.AddObject("a", Floats(1000), ObjectRole::kInput);
  const ObjectId b = update.AddObject("b", Floats(1000), ObjectRole::kInput);
  update.MarkOutput(AddGelu(update, "update_a", {a}, 1000, w1));
  update.MarkOutput(AddGelu(update, "update_b", {b}, 1000, w2));
  RegisterEach(driver, {{3, &make1}, {4, &make2}, {6, &update}});
  Put(driver, 1, 1, /*inline_data=*/true);
  const auto make = [&](uint64_t instance, uint64_t on_w1, uint64_t on_w2) {
    ASSERT_OK(Run(driver, 3, instance, {{x1.value(), 1}}, {on_w1}));
    ASSERT_OK(InstanceDone(w1, 3, instance, {on_w1}));
    ASSERT_OK(Run(driver, 4, instance, {{x2.value(), 1}}, {on_w2}));
    ASSERT_OK(InstanceDone(w2, 4, instance, {on_w2}));
  };
  const auto ids_of = [](proto::HandedBack::Reader back) {
    std::vector<uint64_t> ids;
    for (uint64_t id : back.getIds()) ids.push_back(id);
    std::sort(ids.begin(), ids.end());
    return ids;
  };
  const auto driver_kinds = [&] {
    std::vector<Body::Which> kinds;
    for (const auto& message : outbox_.sent[driver]) kinds.push_back(BodyOf(message).which());
    outbox_.sent[driver].clear();
    return kinds;
  };

  // w2 fails first, putting back 51; the run waits for w1, which took 50 over.
  make(1, 50, 51);
  const size_t before = core_.num_objects();
  ASSERT_OK(Run(driver, 6, 1, {{a.value(), 50}, {b.value(), 51}}, {60, 61}, true));
  Watch(driver, 60);
  driver_kinds();
  ASSERT_OK(InstanceDone(w2, 6, 1, {}, Internal("a kernel failed"), {51}));
  EXPECT_EQ(outbox_.Take(w1, Body::CANCEL_INSTANCE).size(), 1u);
  EXPECT_TRUE(driver_kinds().empty()) << "the run ended before w1 said what it put back";
  ASSERT_OK(InstanceDone(w1, 6, 1, {}, Cancelled("cancelled"), {50}));
  auto sent = std::move(outbox_.sent[driver]);
  ASSERT_EQ(sent.size(), 2u);
  ASSERT_EQ(BodyOf(sent[0]).which(), Body::HANDED_BACK);
  auto back = BodyOf(sent[0]).getHandedBack();
  EXPECT_EQ(back.getGraphId(), 6u);
  EXPECT_EQ(back.getInstance(), 1u);
  EXPECT_EQ(ids_of(back), (std::vector<uint64_t>{50, 51}));
  ASSERT_EQ(BodyOf(sent[1]).which(), Body::OBJECTS_READY);  // then the output fails
  EXPECT_TRUE(BodyOf(sent[1]).getObjectsReady().getObjects()[0].hasError());
  outbox_.sent[driver].clear();
  // 50 and 51 are held by the driver again; 60 and 61 failed (60 watched, both referenced).
  EXPECT_EQ(core_.num_objects(), before + 2);
  for (uint64_t id : {50, 51, 60, 61}) Release(driver, id);
  EXPECT_EQ(core_.num_objects(), before - 2);
  EXPECT_EQ(outbox_.Take(w1, Body::FREE_OBJECTS).size(), 1u);  // 50 freed where it was put back

  // w1 updated 52 before failing (nothing put back): lost; w2's 53 comes back.
  make(2, 52, 53);
  ASSERT_OK(Run(driver, 6, 2, {{a.value(), 52}, {b.value(), 53}}, {62, 63}, true));
  ASSERT_OK(InstanceDone(w1, 6, 2, {}, Internal("the optimizer failed")));
  ASSERT_OK(InstanceDone(w2, 6, 2, {}, Cancelled("cancelled"), {53}));
  auto handed = outbox_.Take(driver, Body::HANDED_BACK);
  ASSERT_EQ(handed.size(), 1u);
  EXPECT_EQ(ids_of(BodyOf(handed[0]).getHandedBack()), std::vector<uint64_t>{53});
  for (uint64_t id : {53, 62, 63}) Release(driver, id);
  EXPECT_EQ(core_.num_objects(), before - 2);

  // Putting back what it was not told to take over (w1 was told 54, not 55): refused.
  make(3, 54, 55);
  ASSERT_OK(Run(driver, 6, 3, {{a.value(), 54}, {b.value(), 55}}, {64, 65}, true));
  EXPECT_THAT(InstanceDone(w1, 6, 3, {}, Internal("failed"), {55}).ToString(),
              ::testing::HasSubstr("it was not told to take it over"));
  // A taker that dies loses what it took: the run ends with the other's put back.
  ASSERT_OK(InstanceDone(w2, 6, 3, {}, Internal("failed"), {55}));
  EXPECT_TRUE(outbox_.Take(driver, Body::HANDED_BACK).empty());
  core_.Disconnected(w1, Unavailable("killed"));
  handed = outbox_.Take(driver, Body::HANDED_BACK);
  ASSERT_EQ(handed.size(), 1u);
  EXPECT_EQ(BodyOf(handed[0]).getHandedBack().getIds()[0], 55u);
}

// A failed run does not wait for ever on a worker that took something over and says nothing: a
// heartbeat timeout after the failure (3 s here) the run ends, what that worker took is lost, and
// what it puts back in a late report is freed on it.
TEST_F(RegisteredGraphTest, AFailedRunGivesUpOnATakerThatDoesNotReport) {
  const Cluster joined = JoinTwoWorkersAndADriver();
  const WorkerId w1 = joined.w1, w2 = joined.w2, driver = joined.driver;
  ObjectId x;
  const Graph make = MakerOn(w1, &x);
  Graph update;
  const ObjectId a = update.AddObject("a", Floats(1000), ObjectRole::kInput);
  const ObjectId y = update.AddObject("y", Floats(1), ObjectRole::kInput);
  update.MarkOutput(AddGelu(update, "update_a", {a}, 1000, w1));
  update.MarkOutput(AddGelu(update, "side", {y}, 1, w2));
  RegisterEach(driver, {{3, &make}, {6, &update}});
  Put(driver, 1, 1, /*inline_data=*/true);
  ASSERT_OK(Run(driver, 3, 1, {{x.value(), 1}}, {50}));
  ASSERT_OK(InstanceDone(w1, 3, 1, {50}));
  ASSERT_OK(Run(driver, 6, 1, {{a.value(), 50}, {y.value(), 1}}, {60, 61}, true));
  Watch(driver, 60);
  // w2 dies: the run fails, and waits for w1, which took 50 over.
  core_.Disconnected(w2, Unavailable("killed"));
  outbox_.sent[driver].clear();
  // w1 stays alive (its heartbeats come) but does not report the run.
  const auto tick_after = [&](int ms) {
    now_ += std::chrono::milliseconds(ms);
    ASSERT_OK(Deliver(w1, [](proto::Envelope::Builder e) { e.initBody().initHeartbeat(); }));
    core_.Tick();
    core_.Flush();
  };
  tick_after(0);
  tick_after(2000);
  EXPECT_TRUE(outbox_.Take(driver, Body::OBJECTS_READY).empty()) << "gave up too early";
  tick_after(1500);
  EXPECT_TRUE(outbox_.Take(driver, Body::HANDED_BACK).empty());
  EXPECT_THAT(ReadyError(driver), ::testing::HasSubstr("died"));
  // w1 reports at last, putting 50 back: nothing holds it, so it is freed there.
  outbox_.Take(w1, Body::FREE_OBJECTS);
  ASSERT_OK(InstanceDone(w1, 6, 1, {}, Cancelled("cancelled"), {50}));
  auto frees = outbox_.Take(w1, Body::FREE_OBJECTS);
  ASSERT_EQ(frees.size(), 1u);
  EXPECT_EQ(BodyOf(frees[0]).getFreeObjects().getIds()[0], 50u);
}

TEST_F(RegisteredGraphTest, TimelineWaitsForTheInstanceAndNamesItsSpans) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  AddGelu(graph, "a", {x}, 1, w1);
  graph.MarkOutput(AddGelu(graph, "b", {x}, 1, w2));
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  Put(driver, 1, 1, /*inline_data=*/true);
  ASSERT_OK(Run(driver, 3, 1, {{x.value(), 1}}, {50}));
  auto finish = [&](WorkerId worker, uint64_t task, const std::vector<uint64_t>& sealed) {
    return Deliver(worker, [&](proto::Envelope::Builder e) {
      auto done = e.initBody().initInstanceFinished();
      done.setGraphId(3);
      done.setInstance(1);
      auto outputs = done.initOutputs(static_cast<unsigned>(sealed.size()));
      for (unsigned i = 0; i < sealed.size(); ++i) {
        outputs[i].setId(sealed[i]);
        outputs[i].setBytes(4);
      }
      WorkerSpans spans;
      spans.tasks.push_back({task, 0, 100, 200, 0});
      rpc::ToWire(spans, done.initSpans());
    });
  };
  auto request = [&](WorkerId from, uint64_t graph_id) {
    return Deliver(from, [&](proto::Envelope::Builder e) {
      e.setRequestId(9);
      auto wire = e.initBody().initTimelineRequest();
      wire.setLastInstances(1);
      wire.setGraphId(graph_id);
    });
  };
  ASSERT_OK(finish(w1, 1, {}));
  ASSERT_OK(request(driver, 3));
  EXPECT_TRUE(outbox_.Take(driver, Body::TIMELINE_REPLY).empty()) << "w2 has not reported yet";
  ASSERT_OK(finish(w2, 2, {50}));
  auto replies = outbox_.Take(driver, Body::TIMELINE_REPLY);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0]->reader().getRoot<proto::Envelope>().getRequestId(), 9u);
  ASSERT_OK_AND_ASSIGN(Timeline timeline, rpc::FromWire(BodyOf(replies[0]).getTimelineReply()));
  ASSERT_EQ(timeline.spans.size(), 2u);
  EXPECT_EQ(timeline.spans[0].worker, w1);
  EXPECT_EQ(timeline.spans[0].name, "a");
  EXPECT_EQ(timeline.spans[0].kind, SpanKind::kForward);
  EXPECT_EQ(timeline.spans[1].worker, w2);
  EXPECT_EQ(timeline.spans[1].name, "b");
  ASSERT_EQ(timeline.processes.size(), 2u);
  EXPECT_EQ(timeline.processes[0].hostname, "host");
  EXPECT_EQ(timeline.processes[0].pid, static_cast<int>(100 + w1.value()));

  // Any graph: answered at once; workers may not ask.
  ASSERT_OK(request(driver, 0));
  EXPECT_EQ(outbox_.Take(driver, Body::TIMELINE_REPLY).size(), 1u);
  EXPECT_EQ(request(w1, 0).code(), StatusCode::kInvalidArgument);
}

TEST_F(RegisteredGraphTest, MembersOfACollectiveGetDistinctWorkersAndTheirGroup) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  const ObjectId p_out = AddGelu(graph, "p", {x}, 100);  // w1
  // Both members would go beside p; the second moves to the other worker.
  AddGelu(graph, "m0", {p_out}, 1, WorkerId(), Member(4, 0, 2));
  AddGelu(graph, "m1", {p_out}, 1, WorkerId(), Member(4, 1, 2));
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  auto parts = outbox_.Take(w2, Body::GRAPH_PART);
  ASSERT_EQ(parts.size(), 1u);
  auto part = BodyOf(parts[0]).getGraphPart();
  EXPECT_EQ(part.getTaskWorkers()[1], w1.value());
  EXPECT_EQ(part.getTaskWorkers()[2], w2.value());
  ASSERT_OK_AND_ASSIGN(rpc::WireTask m0, rpc::FromWire(part.getTasks()[1]));
  ASSERT_OK_AND_ASSIGN(rpc::WireTask m1, rpc::FromWire(part.getTasks()[2]));
  EXPECT_TRUE(m0.spec.attrs.Has(kGroupAttr));
  EXPECT_EQ(m0.spec.attrs.GetInt(kGroupAttr, -1), m1.spec.attrs.GetInt(kGroupAttr, -2));
  EXPECT_EQ(m0.spec.attrs.GetInt(kPositionAttr, -1), 0);
  EXPECT_EQ(m1.spec.attrs.GetInt(kPositionAttr, -1), 0);
}

TEST_F(RegisteredGraphTest, PlacementsThatCannotWorkAreRefusedWithTheReason) {
  const WorkerId w1 = Join(proto::Role::WORKER);
  Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  {
    Graph graph;
    const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
    AddGelu(graph, "stray", {x}, 1, WorkerId(999));
    ASSERT_OK(Register(driver, 1, graph));
    const Status reply = TakeReply(driver);
    EXPECT_EQ(reply.code(), StatusCode::kInfeasible);
    EXPECT_NE(reply.message().find("task 'stray' is pinned to worker999, which is not an alive "
                                   "worker"),
              std::string::npos)
        << reply.ToString();
  }
  {
    Graph graph;
    const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
    for (int rank = 0; rank < 3; ++rank)
      AddGelu(graph, fmt::format("m{}", rank), {x}, 1, WorkerId(), Member(9, rank, 3));
    ASSERT_OK(Register(driver, 2, graph));
    const Status reply = TakeReply(driver);
    EXPECT_EQ(reply.code(), StatusCode::kInfeasible);
    EXPECT_NE(reply.message().find("collective 9 has 3 members but only 2 workers are alive"),
              std::string::npos)
        << reply.ToString();
  }
  {
    Graph graph;
    const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
    AddGelu(graph, "m0", {x}, 1, w1, Member(9, 0, 2));
    AddGelu(graph, "m1", {x}, 1, w1, Member(9, 1, 2));
    ASSERT_OK(Register(driver, 3, graph));
    const Status reply = TakeReply(driver);
    EXPECT_EQ(reply.code(), StatusCode::kInfeasible);
    EXPECT_NE(reply.message().find("task 'm1' is pinned to " + w1.ToString() +
                                   ", which already runs another member of collective 9"),
              std::string::npos)
        << reply.ToString();
  }
  {
    Graph empty;
    empty.AddObject("x", Floats(1), ObjectRole::kInput);
    ASSERT_OK(Register(driver, 4, empty));
    EXPECT_EQ(TakeReply(driver).message(), "graph 4 has no tasks");
  }
  {
    Graph graph;
    const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
    AddGelu(graph, "a", {x});
    ASSERT_OK(Register(driver, 5, graph));
    EXPECT_OK(TakeReply(driver));
    ASSERT_OK(Register(driver, 5, graph));
    EXPECT_EQ(TakeReply(driver).message(), "graph id 5 is invalid or in use");
    ASSERT_OK(Run(driver, 6, 1, {}, {}));
    const Status unknown = TakeReply(driver, 0);
    EXPECT_EQ(unknown.code(), StatusCode::kNotFound);
    EXPECT_EQ(unknown.message(), "graph 6 is not registered by this driver");
  }
}

TEST_F(RegisteredGraphTest, NoAliveWorkerMeansTheGraphIsRefused) {
  const WorkerId driver = Join(proto::Role::DRIVER);
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  AddGelu(graph, "a", {x});
  ASSERT_OK(Register(driver, 1, graph));
  const Status reply = TakeReply(driver);
  EXPECT_EQ(reply.code(), StatusCode::kUnavailable);
  EXPECT_EQ(reply.message(), "no worker is alive to run graph 1");
}

TEST_F(RegisteredGraphTest, MalformedGraphsAreProtocolErrorsNamingWhatIsWrong) {
  Join(proto::Role::WORKER);
  auto registered = [&](const std::function<void(proto::RegisterGraph::Builder)>& fill) {
    const WorkerId driver = Join(proto::Role::DRIVER);
    return Deliver(driver, [&](proto::Envelope::Builder e) {
      auto wire = e.initBody().initRegisterGraph();
      wire.setGraphId(1);
      fill(wire);
    });
  };
  auto object = [](proto::ObjectDecl::Builder decl, uint64_t id) {
    rpc::ToWire(ObjectSpec{ObjectId(id), fmt::format("o{}", id), Floats(1), ObjectRole::kActivation,
                           TaskId()},
                decl);
  };
  auto task = [](proto::Task::Builder out, uint64_t id, std::vector<ObjectId> inputs,
                 std::vector<ObjectId> outputs) {
    TaskSpec spec;
    spec.id = TaskId(id);
    spec.name = fmt::format("t{}", id);
    spec.op = "gelu_forward";
    spec.inputs = std::move(inputs);
    spec.outputs = std::move(outputs);
    std::vector<ObjectSpec> decls;
    decls.reserve(spec.outputs.size());
    for (ObjectId output : spec.outputs)
      decls.push_back(ObjectSpec{output, "o", Floats(1), ObjectRole::kActivation, spec.id});
    rpc::ToWire(spec, decls, out);
  };
  Status status =
      registered([&](proto::RegisterGraph::Builder wire) { object(wire.initObjects(1)[0], 2); });
  EXPECT_EQ(status.message(), "graph 1 object ids must be dense from 1");
  status = registered([&](proto::RegisterGraph::Builder wire) {
    object(wire.initObjects(1)[0], 1);
    task(wire.initTasks(1)[0], 2, {ObjectId(1)}, {});
  });
  EXPECT_EQ(status.message(), "graph 1 task ids must be dense from 1");
  status = registered([&](proto::RegisterGraph::Builder wire) {
    object(wire.initObjects(1)[0], 1);
    task(wire.initTasks(1)[0], 1, {ObjectId(5)}, {});
  });
  EXPECT_EQ(status.message(), "task 't1' reads an unknown object");
  status = registered([&](proto::RegisterGraph::Builder wire) {
    auto objects = wire.initObjects(2);
    object(objects[0], 1);
    object(objects[1], 2);
    auto tasks = wire.initTasks(2);
    task(tasks[0], 1, {ObjectId(1)}, {ObjectId(2)});
    task(tasks[1], 2, {ObjectId(1)}, {ObjectId(2)});
  });
  EXPECT_EQ(status.message(), "task 't2' produces an unknown object or one another task produces");
  status = registered([&](proto::RegisterGraph::Builder wire) {
    auto objects = wire.initObjects(2);
    object(objects[0], 1);
    object(objects[1], 2);
    task(wire.initTasks(1)[0], 1, {ObjectId(1)}, {ObjectId(2)});
    wire.initOutputs(1).set(0, 3);
  });
  EXPECT_EQ(status.message(), "graph 1 returns an unknown object");
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
}

TEST_F(RegisteredGraphTest, AWorkerDyingMidInstanceCancelsItsPeersAndFailsTheOutputs) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1 << 20), ObjectRole::kInput);
  graph.MarkOutput(AddGelu(graph, "a", {x}));
  AddGelu(graph, "b", {x});
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  Put(driver, 1, 1 << 20, /*inline_data=*/false);
  ASSERT_OK(Run(driver, 3, 8, {{x.value(), 1}}, {60}));
  for (WorkerId worker : {w1, w2}) {
    auto runs = outbox_.Take(worker, Body::RUN_GRAPH);
    ASSERT_EQ(runs.size(), 1u);
    auto inputs = BodyOf(runs[0]).getRunGraph().getInputs();
    ASSERT_EQ(inputs.size(), 1u) << "a large input is pulled from its holder";
    EXPECT_EQ(inputs[0].getSource().getHolder(), driver.value());
  }
  Watch(driver, 60);
  core_.Disconnected(w2, Unavailable("connection reset"));
  core_.Flush();
  auto cancels = outbox_.Take(w1, Body::CANCEL_INSTANCE);
  ASSERT_EQ(cancels.size(), 1u);
  const std::string why =
      rpc::FromWire(BodyOf(cancels[0]).getCancelInstance().getError()).message();
  EXPECT_NE(why.find(w2.ToString() + " (pid"), std::string::npos) << why;
  EXPECT_NE(why.find("died while running its part of graph 3 (instance 8)"), std::string::npos)
      << why;
  const std::string failed = ReadyError(driver);
  EXPECT_NE(failed.find("died while running its part of graph 3"), std::string::npos) << failed;
  // w1's late report changes nothing.
  ASSERT_OK(InstanceDone(w1, 3, 8, {}));
}

// Every recovery from a lost worker registers the step graph again on the workers there are; the
// graphs placed on the worker that died can never run again. They are forgotten, here and on the
// workers that hold their parts, so the scheduler holds no more graphs after twenty recoveries
// than after one (it used to keep every one: "~240 KB per recovery"), and running a retired
// graph is refused saying why. A driver's graphs go when it leaves.
TEST_F(RegisteredGraphTest, GraphsPlacedOnADeadWorkerAreForgottenAfterEachRecovery) {
  const WorkerId survivor = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1 << 20), ObjectRole::kInput);
  graph.MarkOutput(AddGelu(graph, "a", {x}));
  AddGelu(graph, "b", {x});
  WorkerId dead;
  for (uint64_t recovery = 1; recovery <= 20; ++recovery) {
    const WorkerId joined = Join(proto::Role::WORKER);
    const uint64_t graph_id = 100 + recovery;
    ASSERT_OK(Register(driver, graph_id, graph));
    ASSERT_OK(TakeReply(driver));
    EXPECT_EQ(core_.num_graphs(), 1u) << "recovery " << recovery;
    Put(driver, recovery, 1 << 20, /*inline_data=*/false);
    ASSERT_OK(Run(driver, graph_id, 1, {{x.value(), recovery}}, {1000 + recovery}));
    ASSERT_EQ(outbox_.Take(joined, Body::RUN_GRAPH).size(), 1u) << "the graph uses both workers";
    core_.Disconnected(joined, Unavailable("killed"));  // mid-instance, as in a failed step
    core_.Flush();
    EXPECT_EQ(core_.num_graphs(), 0u) << "recovery " << recovery;
    EXPECT_FALSE(outbox_.Take(survivor, Body::FORGET_GRAPHS).empty())
        << "the survivor drops its part too";
    dead = joined;
  }
  outbox_.Take(driver, Body::REPLY);
  ASSERT_OK(Run(driver, 120, 2, {{x.value(), 20}}, {2000}));
  const Status refused = TakeReply(driver, /*request_id=*/0);
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable) << refused.ToString();
  EXPECT_NE(refused.message().find("graph 120 can no longer run"), std::string::npos)
      << refused.ToString();
  EXPECT_NE(refused.message().find(dead.ToString()), std::string::npos) << refused.ToString();

  ASSERT_OK(Register(driver, 200, graph));  // on the survivor alone
  ASSERT_OK(TakeReply(driver));
  EXPECT_EQ(core_.num_graphs(), 1u);
  core_.Disconnected(driver, Unavailable("driver exited"));
  EXPECT_EQ(core_.num_graphs(), 0u);
}

TEST_F(RegisteredGraphTest, BadBindingsAndFailedPartsFailTheInstanceOutputs) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  graph.MarkOutput(AddGelu(graph, "a", {x}));
  AddGelu(graph, "b", {x});
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  Put(driver, 1, 1, /*inline_data=*/true);
  Put(driver, 2, 8, /*inline_data=*/true);

  ASSERT_OK(Run(driver, 3, 1, {{x.value(), 2}}, {70}));
  Watch(driver, 70);
  EXPECT_NE(ReadyError(driver).find("but was bound to"), std::string::npos);
  ASSERT_OK(Run(driver, 3, 2, {}, {71}));
  Watch(driver, 71);
  EXPECT_NE(ReadyError(driver).find("input 'x' of graph 3 is not bound"), std::string::npos);
  EXPECT_TRUE(outbox_.Take(w1, Body::RUN_GRAPH).empty());
  EXPECT_FALSE(Run(driver, 3, 3, {{x.value(), 1}}, {}).ok()) << "one output id per output";

  ASSERT_OK(Run(driver, 3, 4, {{x.value(), 1}}, {72}));
  EXPECT_FALSE(Run(driver, 3, 4, {{x.value(), 1}}, {73}).ok()) << "instance 4 is running";
  Watch(driver, 72);
  ASSERT_OK(InstanceDone(w2, 3, 4, {}, Internal("kernel crashed")));
  auto cancels = outbox_.Take(w1, Body::CANCEL_INSTANCE);
  ASSERT_EQ(cancels.size(), 1u);
  EXPECT_TRUE(outbox_.Take(w2, Body::CANCEL_INSTANCE).empty());
  const std::string failed = ReadyError(driver);
  EXPECT_NE(failed.find(w2.ToString() + " (pid"), std::string::npos) << failed;
  EXPECT_NE(failed.find("kernel crashed"), std::string::npos) << failed;
  ASSERT_OK(InstanceDone(w1, 3, 4, {}));
  for (uint64_t id : {70, 71, 72, 1, 2}) Release(driver, id);
  EXPECT_EQ(core_.num_objects(), 0u);
}

// A GPU worker's graph takes host values for its device inputs (a driver's batch): its executor
// copies them to the GPU. Shape and dtype must still match.
TEST_F(RegisteredGraphTest, AHostObjectBindsADeviceInputOfTheSameShapeAndDtype) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", FloatsOnGpu(1), ObjectRole::kInput);
  graph.MarkOutput(AddGelu(graph, "a", {x}));
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  Put(driver, 1, 1, /*inline_data=*/true);  // f32[1] on the host
  Put(driver, 2, 2, /*inline_data=*/true);  // f32[2]
  ASSERT_OK(Run(driver, 3, 1, {{x.value(), 1}}, {70}));
  EXPECT_EQ(outbox_.Take(w1, Body::RUN_GRAPH).size() + outbox_.Take(w2, Body::RUN_GRAPH).size(),
            1u);
  ASSERT_OK(Run(driver, 3, 2, {{x.value(), 2}}, {71}));
  Watch(driver, 71);
  EXPECT_NE(ReadyError(driver).find("but was bound to"), std::string::npos);
}

// A graph with GPU tasks runs on GPU workers only (its host-side tasks too); without any, its
// registration is refused saying so, instead of a CPU worker failing at the first binding.
TEST_F(RegisteredGraphTest, AGraphWithGpuTasksIsPlacedOnGpuWorkersOnly) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", FloatsOnGpu(1), ObjectRole::kInput);
  const ObjectId y = graph.AddObject("on_gpu.out", FloatsOnGpu(1), ObjectRole::kActivation);
  TaskSpec on_gpu_task;
  on_gpu_task.name = "on_gpu";
  on_gpu_task.op = "gelu_forward";
  on_gpu_task.inputs = {x};
  on_gpu_task.outputs = {y};
  on_gpu_task.device_kind = DeviceKind::kCuda;
  graph.AddTask(std::move(on_gpu_task));
  graph.MarkOutput(AddGelu(graph, "on_host", {y}));
  ASSERT_OK(Register(driver, 3, graph));
  const Status refused = TakeReply(driver);
  EXPECT_EQ(refused.code(), StatusCode::kInfeasible) << refused.ToString();
  EXPECT_NE(refused.message().find("runs task 'on_gpu' on a GPU, and no GPU worker is alive"),
            std::string::npos)
      << refused.ToString();
  const WorkerId gpu_worker = Join(proto::Role::WORKER, "secret", 1 << 30, "NVIDIA H200 (cuda:0)");
  ASSERT_OK(Register(driver, 4, graph));
  EXPECT_OK(TakeReply(driver));
  EXPECT_EQ(outbox_.Take(gpu_worker, Body::GRAPH_PART).size(), 1u);
  EXPECT_TRUE(outbox_.Take(w1, Body::GRAPH_PART).empty());
  EXPECT_TRUE(outbox_.Take(w2, Body::GRAPH_PART).empty());
}

// A failed instance aborts the groups of its collectives on every member, the one that reported
// the failure too: each drops that formation, so the group's next collective (a replay's) forms
// it afresh on all of them (worker/collective_engine.h).
TEST_F(RegisteredGraphTest, AFailedInstanceAbortsItsCollectiveGroupsOnEveryMember) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  graph.MarkOutput(AddGelu(graph, "m0", {x}, 1, w1, Member(5, 0, 2)));
  graph.MarkOutput(AddGelu(graph, "m1", {x}, 1, w2, Member(5, 1, 2)));
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  Put(driver, 1, 1, /*inline_data=*/true);
  ASSERT_OK(Run(driver, 3, 4, {{x.value(), 1}}, {72, 73}));
  for (WorkerId worker : {w1, w2})
    EXPECT_TRUE(outbox_.Take(worker, Body::COLLECTIVE_ABORT).empty());
  ASSERT_OK(InstanceDone(w2, 3, 4, {}, Internal("kernel crashed")));
  for (WorkerId worker : {w1, w2}) {
    auto aborts = outbox_.Take(worker, Body::COLLECTIVE_ABORT);
    ASSERT_EQ(aborts.size(), 1u) << worker.ToString();
    const std::string why =
        rpc::FromWire(BodyOf(aborts[0]).getCollectiveAbort().getError()).message();
    EXPECT_NE(why.find("kernel crashed"), std::string::npos) << why;
  }
}

// Every collective a worker runs has one position in its single order: the instances' bases
// count each worker's members over every instance started there, a driver's graph's steps and
// submitted collectives alike, so every worker meets them in the order they started.
TEST_F(RegisteredGraphTest, CollectiveBasesCountEachWorkersMembersAcrossInstances) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;  // two collectives over w1 and w2: each worker runs two members per step
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  const ObjectId a0 = AddGelu(graph, "a0", {x}, 1, w1, Member(1, 0, 2));
  const ObjectId a1 = AddGelu(graph, "a1", {x}, 1, w2, Member(1, 1, 2));
  graph.MarkOutput(AddGelu(graph, "b0", {a0}, 1, w1, Member(2, 0, 2)));
  graph.MarkOutput(AddGelu(graph, "b1", {a1}, 1, w2, Member(2, 1, 2)));
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  Put(driver, 1, 1, /*inline_data=*/true);
  // The base each worker got in the one RunGraph sent to it (and that message's instance).
  auto bases = [&](WorkerId worker) {
    std::map<uint64_t, int64_t> out;
    for (auto& message : outbox_.Take(worker, Body::RUN_GRAPH)) {
      for (auto base : BodyOf(message).getRunGraph().getCollectiveBases()) {
        if (base.getWorker() == worker.value()) out[base.getWorker()] = base.getBase();
      }
    }
    return out;
  };
  ASSERT_OK(Run(driver, 3, 1, {{x.value(), 1}}, {50, 52}));
  EXPECT_EQ(bases(w1), (std::map<uint64_t, int64_t>{{w1.value(), 0}}));
  EXPECT_EQ(bases(w2), (std::map<uint64_t, int64_t>{{w2.value(), 0}}));
  ASSERT_OK(InstanceDone(w1, 3, 1, {50}));
  ASSERT_OK(InstanceDone(w2, 3, 1, {52}));
  ASSERT_OK(Run(driver, 3, 2, {{x.value(), 1}}, {51, 53}));  // next step: after 2 members each
  EXPECT_EQ(bases(w1), (std::map<uint64_t, int64_t>{{w1.value(), 2}}));
  EXPECT_EQ(bases(w2), (std::map<uint64_t, int64_t>{{w2.value(), 2}}));
  // A submitted collective over the same workers comes after both steps' members.
  for (int64_t rank = 0; rank < 2; ++rank) {
    ASSERT_OK(Deliver(driver, [&](proto::Envelope::Builder e) {
      TaskSpec spec;
      spec.id = TaskId(20 + static_cast<uint64_t>(rank));
      spec.name = fmt::format("r{}", rank);
      spec.op = "all_reduce";
      spec.inputs = {ObjectId(1)};
      spec.outputs = {ObjectId(120 + static_cast<uint64_t>(rank))};
      spec.attrs = Member(8, rank, 2);
      rpc::ToWire(spec,
                  {ObjectSpec{spec.outputs[0], fmt::format("r{}.out", rank), Floats(1),
                              ObjectRole::kActivation, spec.id}},
                  e.initBody().initSubmitTasks().initTasks(1)[0]);
    }));
  }
  EXPECT_EQ(bases(w1), (std::map<uint64_t, int64_t>{{w1.value(), 4}}));
  EXPECT_EQ(bases(w2), (std::map<uint64_t, int64_t>{{w2.value(), 4}}));
}

// Channels (core/collective_task.h): each channel's members count their positions and bases of
// their own, and a channel's collectives get a group of their own over the same workers.
TEST_F(RegisteredGraphTest, EachChannelHasItsOwnOrderAndGroups) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;  // reduce a, gather g, reduce b over w1 and w2; g on the gather channel
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  const auto gather = [](int64_t collective, int64_t rank) {
    Attrs attrs = Member(collective, rank, 2);
    attrs.Set(kChannelAttr, int64_t{kGatherChannel});
    return attrs;
  };
  const ObjectId a0 = AddGelu(graph, "a0", {x}, 1, w1, Member(1, 0, 2));
  const ObjectId a1 = AddGelu(graph, "a1", {x}, 1, w2, Member(1, 1, 2));
  const ObjectId g0 = AddGelu(graph, "g0", {a0}, 1, w1, gather(2, 0));
  const ObjectId g1 = AddGelu(graph, "g1", {a1}, 1, w2, gather(2, 1));
  graph.MarkOutput(AddGelu(graph, "b0", {g0}, 1, w1, Member(3, 0, 2)));
  graph.MarkOutput(AddGelu(graph, "b1", {g1}, 1, w2, Member(3, 1, 2)));
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  auto parts = outbox_.Take(w1, Body::GRAPH_PART);
  ASSERT_EQ(parts.size(), 1u);
  auto part = BodyOf(parts[0]).getGraphPart();
  std::map<std::string, rpc::WireTask> tasks;
  for (auto task : part.getTasks()) {
    ASSERT_OK_AND_ASSIGN(rpc::WireTask parsed, rpc::FromWire(task));
    tasks.emplace(parsed.spec.name, std::move(parsed));
  }
  const auto attr = [&](const std::string& task, const char* name) {
    return tasks.at(task).spec.attrs.GetInt(name, -1);
  };
  EXPECT_EQ(attr("a0", kPositionAttr), 0);
  EXPECT_EQ(attr("b0", kPositionAttr), 1);  // after a0 on channel 0
  EXPECT_EQ(attr("g0", kPositionAttr), 0);  // the first on its channel
  EXPECT_EQ(attr("a0", kGroupAttr), attr("b0", kGroupAttr));
  EXPECT_NE(attr("a0", kGroupAttr), attr("g0", kGroupAttr));
  EXPECT_EQ(attr("g0", kGroupAttr), attr("g1", kGroupAttr));

  Put(driver, 1, 1, /*inline_data=*/true);
  auto bases = [&](WorkerId worker) {
    std::map<int, int64_t> out;  // channel -> base
    for (auto& message : outbox_.Take(worker, Body::RUN_GRAPH)) {
      for (auto base : BodyOf(message).getRunGraph().getCollectiveBases()) {
        if (base.getWorker() == worker.value()) out[base.getChannel()] = base.getBase();
      }
    }
    return out;
  };
  ASSERT_OK(Run(driver, 3, 1, {{x.value(), 1}}, {50, 52}));
  EXPECT_EQ(bases(w1), (std::map<int, int64_t>{{0, 0}, {kGatherChannel, 0}}));
  ASSERT_OK(InstanceDone(w1, 3, 1, {50}));
  ASSERT_OK(InstanceDone(w2, 3, 1, {52}));
  ASSERT_OK(Run(driver, 3, 2, {{x.value(), 1}}, {51, 53}));  // 2 members on 0, 1 on the other
  EXPECT_EQ(bases(w1), (std::map<int, int64_t>{{0, 2}, {kGatherChannel, 1}}));
  EXPECT_EQ(bases(w2), (std::map<int, int64_t>{{0, 2}, {kGatherChannel, 1}}));
}

// A worker that reports one output twice (after its driver let go of it, so the first seal frees
// it) commits a protocol error: its connection closes; the scheduler does not abort.
TEST_F(RegisteredGraphTest, AnOutputSealedTwiceInOneReportIsAProtocolError) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  graph.MarkOutput(AddGelu(graph, "a", {x}));
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  Put(driver, 1, 1, /*inline_data=*/true);
  ASSERT_OK(Run(driver, 3, 1, {{x.value(), 1}}, {70}));
  Release(driver, 70);
  int refused = 0;
  for (WorkerId worker : {w1, w2}) {
    const Status status = InstanceDone(worker, 3, 1, {70, 70});
    if (status.ok()) continue;  // not involved in the instance: ignored
    ++refused;
    EXPECT_NE(status.message().find("sealed obj70 twice"), std::string::npos) << status.ToString();
  }
  EXPECT_EQ(refused, 1);
}

}  // namespace
}  // namespace tessera::testing
