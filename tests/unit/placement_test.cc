// The placement policies (scheduler/placement.h), as pure functions.
#include "scheduler/placement.h"

#include "test_util.h"
#include "unit/scheduler_test_graphs.h"

namespace tessera::testing {
namespace {

const WorkerId kA(1), kB(2), kC(3);

WorkerLoad Load(WorkerId id, int64_t free_bytes, int in_flight = 0, bool alive = true) {
  return WorkerLoad{id, alive, free_bytes, in_flight};
}

// A one-task graph as a submitted task becomes (GraphRegistry::TaskTemplate): `inputs` graph
// inputs of 8 bytes each, read by one task with the given memory estimate and pin.
Graph OneTask(int inputs, int64_t memory_estimate = 0, WorkerId pinned = WorkerId()) {
  Graph graph;
  std::vector<ObjectId> read;
  read.reserve(static_cast<size_t>(inputs));
  for (int i = 0; i < inputs; ++i) {
    read.push_back(graph.AddObject(fmt::format("in{}", i), Floats(2), ObjectRole::kInput));
  }
  TaskSpec task;
  task.name = "task";
  task.op = "gelu_forward";
  task.inputs = read;
  task.outputs = {graph.AddObject("out0", Floats(1), ObjectRole::kActivation)};
  task.pinned_worker = pinned;
  task.memory_estimate_bytes = memory_estimate;
  graph.MarkOutput(task.outputs[0]);
  graph.AddTask(std::move(task));
  return graph;
}

PlacementView View(
    std::vector<WorkerLoad> workers,
    std::unordered_map<ObjectId, std::vector<std::pair<WorkerId, int64_t>>> held = {}) {
  return PlacementView{std::move(workers), std::move(held)};
}

// What PlaceTask did for a submitted task, PlaceGraph does for its one-task graph.
TEST(PlaceGraphTest, ATaskGoesPinnedElseToMostLocalBytesElseLeastLoadedElseRoomiest) {
  const std::vector<WorkerLoad> workers = {Load(kA, 100, 2), Load(kB, 100, 1), Load(kC, 10, 0)};
  EXPECT_EQ(*PlaceGraph(OneTask(1, 0, kC), View(workers)), (std::vector<WorkerId>{kC}));

  // kC holds most but cannot fit it.
  const auto local =
      View(workers, {{ObjectId(1), {{kA, 8}, {kB, 4}, {kC, 1000}}}, {ObjectId(2), {{kA, 8}}}});
  EXPECT_EQ(*PlaceGraph(OneTask(2, 50), local), (std::vector<WorkerId>{kA}));

  EXPECT_EQ(*PlaceGraph(OneTask(1, 50), View(workers)), (std::vector<WorkerId>{kB}))
      << "fewest in flight among those that fit";

  EXPECT_EQ(
      *PlaceGraph(OneTask(1, 1000), View({Load(kA, 10), Load(kB, 20), Load(kC, 30, 0, false)})),
      (std::vector<WorkerId>{kB}))
      << "nothing fits: the roomiest alive worker, which will spill";
}

TEST(PlaceGraphTest, APinOnADeadWorkerIsInfeasibleAndNoWorkerIsUnavailable) {
  const Result<std::vector<WorkerId>> dead =
      PlaceGraph(OneTask(1, 0, kB), View({Load(kA, 100), Load(kB, 100, 0, false)}));
  EXPECT_EQ(dead.status().code(), StatusCode::kInfeasible);
  EXPECT_EQ(dead.status().message(),
            "task 'task' is pinned to worker2, which is not an alive worker");
  EXPECT_EQ(PlaceGraph(OneTask(1), View({})).status().code(), StatusCode::kUnavailable);
}

// What PlaceGang did for a dynamic collective, PlaceGraph does for the graph of its members.
TEST(PlaceGraphTest, ACollectivesMembersGoToDistinctWorkersRankByRank) {
  Graph members;
  for (int rank = 0; rank < 3; ++rank) {
    const ObjectId in =
        members.AddObject(fmt::format("rank{}/in0", rank), Floats(2), ObjectRole::kInput);
    AddGelu(members, fmt::format("m{}", rank), {in}, 1, WorkerId(), Member(7, rank, 3));
  }
  const std::vector<WorkerLoad> workers = {Load(kA, 100), Load(kB, 100, 3), Load(kC, 100, 1)};
  // Every member's input is on kA.
  std::unordered_map<ObjectId, std::vector<std::pair<WorkerId, int64_t>>> held;
  for (const ObjectId input : members.InputObjects()) held[input] = {{kA, 100}};
  ASSERT_OK_AND_ASSIGN(std::vector<WorkerId> placed, PlaceGraph(members, View(workers, held)));
  EXPECT_EQ(placed, (std::vector<WorkerId>{kA, kC, kB}));

  Graph two;
  for (int rank = 0; rank < 2; ++rank) {
    AddGelu(two, fmt::format("m{}", rank), {}, 1, WorkerId(), Member(7, rank, 2));
  }
  const Result<std::vector<WorkerId>> too_many = PlaceGraph(two, View({Load(kA, 100)}));
  EXPECT_EQ(too_many.status().code(), StatusCode::kInfeasible);
  EXPECT_EQ(too_many.status().message(),
            "collective 7 has 2 members but only 1 workers are alive: start more workers or plan "
            "a smaller group");
}

TEST(PlaceGraphTest, PinnedElseBesideTheLargestProducedInputElseLeastLoaded) {
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1 << 20), ObjectRole::kInput);
  const ObjectId small = AddGelu(graph, "small", {x}, 10);  // least loaded: A
  const ObjectId big = AddGelu(graph, "big", {x}, 1000);    // least loaded: B
  AddGelu(graph, "join", {small, big, x});                  // beside big (x is no task's): B
  AddGelu(graph, "pinned", {big}, 1, kA);                   // A
  AddGelu(graph, "fresh", {x});                             // A 2, B 2, C 0: C
  ASSERT_OK_AND_ASSIGN(std::vector<WorkerId> placed, PlaceGraph(graph, ViewOf({kA, kB, kC})));
  EXPECT_EQ(placed, (std::vector<WorkerId>{kA, kB, kB, kA, kC}));
}

TEST(PlaceGraphTest, ALaterProducerDoesNotDrawItsConsumer) {
  Graph graph;
  const ObjectId late = graph.AddObject("late", Floats(1000), ObjectRole::kActivation);
  AddGelu(graph, "reader", {late});  // its input's producer comes later: least loaded, A
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  TaskSpec producer;
  producer.name = "producer";
  producer.op = "gelu_forward";
  producer.inputs = {x};
  producer.outputs = {late};
  graph.AddTask(std::move(producer));  // B
  ASSERT_OK_AND_ASSIGN(std::vector<WorkerId> placed, PlaceGraph(graph, ViewOf({kA, kB})));
  EXPECT_EQ(placed, (std::vector<WorkerId>{kA, kB}));
}

TEST(PlaceGraphTest, CollectiveMembersMoveToTheLeastLoadedWorkerRunningNone) {
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  const ObjectId p = AddGelu(graph, "p", {x}, 100);           // A
  AddGelu(graph, "q", {x});                                   // B
  AddGelu(graph, "m0", {p}, 1, WorkerId(), Member(5, 0, 3));  // beside p: A
  AddGelu(graph, "m1", {p}, 1, WorkerId(), Member(5, 1, 3));  // A taken: C (fewest)
  AddGelu(graph, "m2", {p}, 1, WorkerId(), Member(5, 2, 3));  // A, C taken: B
  ASSERT_OK_AND_ASSIGN(std::vector<WorkerId> placed, PlaceGraph(graph, ViewOf({kA, kB, kC})));
  EXPECT_EQ(placed, (std::vector<WorkerId>{kA, kB, kA, kC, kB}));
}

TEST(PlaceGraphTest, PlacementsThatCannotWorkAreInfeasibleNamingTheTaskOrCollective) {
  Graph stray, pinned_together, too_many, split_edge;
  AddGelu(stray, "stray", {}, 1, WorkerId(9));
  const ObjectId first = AddGelu(split_edge, "first", {}, 1, kA);
  const ObjectId second = AddGelu(split_edge, "second", {}, 1, kB);
  split_edge.AddControlEdge(split_edge.object(first).producer, split_edge.object(second).producer);
  AddGelu(pinned_together, "m0", {}, 1, kA, Member(2, 0, 2));
  AddGelu(pinned_together, "m1", {}, 1, kA, Member(2, 1, 2));
  for (int rank = 0; rank < 3; ++rank) {
    AddGelu(too_many, fmt::format("m{}", rank), {}, 1, WorkerId(), Member(4, rank, 3));
  }
  const std::vector<std::pair<const Graph*, std::string>> cases = {
      {&stray, "task 'stray' is pinned to worker9, which is not an alive worker"},
      {&pinned_together,
       "task 'm1' is pinned to worker1, which already runs another member of collective 2: "
       "members need distinct workers"},
      {&too_many,
       "collective 4 has 3 members but only 2 workers are alive: start more workers or plan a "
       "smaller group"},
      {&split_edge,
       "task 'second' must start after task 'first', but they are placed on worker2 and "
       "worker1: a control edge needs both tasks on one worker (pin them together)"},
  };
  for (const auto& [graph, message] : cases) {
    const Status status = PlaceGraph(*graph, ViewOf({kA, kB})).status();
    EXPECT_EQ(status.code(), StatusCode::kInfeasible);
    EXPECT_EQ(status.message(), message);
  }
  Graph inconsistent;
  AddGelu(inconsistent, "bad", {}, 1, WorkerId(), Attrs{{kCollectiveAttr, int64_t{1}}});
  EXPECT_EQ(PlaceGraph(inconsistent, ViewOf({kA})).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlaceGraph(Graph(), ViewOf({})).status().code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace tessera::testing
