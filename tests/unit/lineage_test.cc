// Lineage's references (scheduler/lineage.h): an entry lives while one of its outputs exists or
// while a task that reads one of its outputs keeps its own entry.
#include "scheduler/lineage.h"

#include "test_util.h"

namespace tessera::testing {
namespace {

// A task `id` reading `inputs`, producing object `output`.
TaskSpec Task(uint64_t id, const std::vector<uint64_t>& inputs, uint64_t output) {
  TaskSpec spec;
  spec.id = TaskId(id);
  spec.name = fmt::format("t{}", id);
  for (uint64_t input : inputs) spec.inputs.push_back(ObjectId(input));
  spec.outputs = {ObjectId(output)};
  return spec;
}

std::vector<ObjectSpec> Output(uint64_t id) {
  return {ObjectSpec{ObjectId(id), fmt::format("o{}", id), {}, ObjectRole::kActivation, {}}};
}

TEST(LineageTest, AChainStaysWhileItsLastObjectDoes) {
  Lineage lineage;
  lineage.Record(Task(10, {1}, 2), Output(2), WorkerId(9));  // 1 is a Put: no lineage
  lineage.Record(Task(11, {2}, 3), Output(3), WorkerId(9));
  lineage.Record(Task(12, {3}, 4), Output(4), WorkerId(9));
  EXPECT_EQ(lineage.ProducerOf(ObjectId(1)), nullptr);
  ASSERT_NE(lineage.ProducerOf(ObjectId(3)), nullptr);
  EXPECT_EQ(lineage.ProducerOf(ObjectId(3))->spec.name, "t11");
  // The intermediates are freed: their entries stay for o4's sake.
  lineage.OutputFreed(ObjectId(2));
  lineage.OutputFreed(ObjectId(3));
  EXPECT_EQ(lineage.size(), 3u);
  ASSERT_NE(lineage.ProducerOf(ObjectId(2)), nullptr);
  // Revived to be rebuilt and freed again: still balanced.
  lineage.OutputRevived(ObjectId(2));
  lineage.OutputFreed(ObjectId(2));
  EXPECT_EQ(lineage.size(), 3u);
  // o4 goes: the whole chain goes.
  lineage.OutputFreed(ObjectId(4));
  EXPECT_EQ(lineage.size(), 0u);
  EXPECT_EQ(lineage.ProducerOf(ObjectId(2)), nullptr);
}

TEST(LineageTest, ASharedInputStaysUntilEveryReaderGoes) {
  Lineage lineage;
  lineage.Record(Task(10, {}, 2), Output(2), WorkerId(9));
  lineage.Record(Task(11, {2}, 3), Output(3), WorkerId(9));
  lineage.Record(Task(12, {2, 2}, 4), Output(4), WorkerId(9));  // reads it twice
  lineage.OutputFreed(ObjectId(2));
  lineage.OutputFreed(ObjectId(3));
  EXPECT_NE(lineage.ProducerOf(ObjectId(2)), nullptr) << "t12 still needs t10";
  lineage.OutputFreed(ObjectId(4));
  EXPECT_EQ(lineage.size(), 0u);
}

TEST(LineageTest, ALongChainLetGoAtItsEndDoesNotRecurse) {
  Lineage lineage;
  constexpr uint64_t kLength = 200'000;
  for (uint64_t t = 0; t < kLength; ++t) {
    lineage.Record(Task(t + 1, {t + 100}, t + 101), Output(t + 101), WorkerId(9));
    if (t > 0) lineage.OutputFreed(ObjectId(t + 100));
  }
  EXPECT_EQ(lineage.size(), kLength);
  lineage.OutputFreed(ObjectId(kLength + 100));
  EXPECT_EQ(lineage.size(), 0u);
}

}  // namespace
}  // namespace tessera::testing
