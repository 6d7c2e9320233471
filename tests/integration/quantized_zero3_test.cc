// ZeRO-3 with quantized collectives (ParallelConfig::quantize_bits, `--quantize-collectives`:
// ZeRO++'s qwZ and qgZ) on a local cluster of four real worker processes: every parameter gather
// and gradient reduce-scatter carries the attribute; the bytes each rank sends per step are the
// exact ZeRO-3 run's with those collectives at their quantized size, 1/2 (int8) and 1/4 (int4)
// of what bf16 would send, within 2%; the losses stay within 1% of the exact run's; plans that
// cannot quantize are refused by name.
#include <cmath>
#include <memory>

#include <fmt/format.h>
#include <gmock/gmock.h>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "collectives/quantized.h"
#include "core/collective_task.h"
#include "gpt2_test_util.h"
#include "plan_equivalence.h"
#include "test_util.h"
#include "tiny_gpt2_cluster.h"
#include "training/token_dataset.h"
#include "training/trainer.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kWorkers = 4;
constexpr int kSteps = 20;
constexpr int64_t kBatch = 8;
constexpr int64_t kSeqLen = 64;

TrainingPlan Zero3Plan(int bits) {
  TrainingPlan plan;
  plan.batch = kBatch;
  plan.seq_len = kSeqLen;
  plan.parallel.data_parallel = kWorkers;
  plan.parallel.zero_stage = 3;
  plan.parallel.quantize_bits = bits;
  return plan;
}

Result<std::vector<StepReport>> Train(Trainer& trainer) {
  return TrainOnSyntheticTokens(trainer, kBatch, kSeqLen, 0, kSteps);
}

// A step's gathers and reduce-scatters on rank 0: what each sends exact (f32) and as planned.
struct Quantizable {
  int64_t collectives = 0, quantized = 0;
  int64_t f32_bytes = 0, planned_bytes = 0;
};

Quantizable CountQuantizable(const Graph& graph) {
  Quantizable q;
  for (const TaskSpec& task : graph.tasks()) {
    Result<std::optional<CollectiveMembership>> member = CollectiveOf(task);
    if (!member.ok() || !member->has_value() || (*member)->rank != 0) continue;
    if (task.op != "all_gather" && task.op != "reduce_scatter") continue;
    const bool gather = task.op == "all_gather";
    const int64_t count = gather ? graph.object(task.inputs[0]).meta.numel()
                                 : graph.object(task.outputs[0]).meta.numel();
    ++q.collectives;
    q.f32_bytes += int64_t{kWorkers - 1} * count * 4;
    if (task.attrs.Has(kQuantizeBitsAttr)) {
      ++q.quantized;
      q.planned_bytes += QuantizedCollectiveBytes(
          count, kWorkers, static_cast<int>(task.attrs.GetInt(kQuantizeBitsAttr, 0)));
    } else {
      q.planned_bytes += int64_t{kWorkers - 1} * count * 4;
    }
  }
  return q;
}

class QuantizedZero3Test : public TinyGpt2ClusterTest<QuantizedZero3Test> {
 public:
  static constexpr int kClusterWorkers = kWorkers;
};

TEST_F(QuantizedZero3Test, Int8AndInt4SendAHalfAndAQuarterOfBf16WithinOnePercentOfTheLosses) {
  ASSERT_OK_AND_ASSIGN(auto exact, Distributed(Zero3Plan(0)));
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> expected, Train(*exact));
  const Quantizable exact_counts = CountQuantizable(exact->step_graph().graph);
  EXPECT_EQ(exact_counts.quantized, 0);
  exact.reset();
  for (int bits : {8, 4}) {
    SCOPED_TRACE(fmt::format("int{}", bits));
    ASSERT_OK_AND_ASSIGN(auto quantized, Distributed(Zero3Plan(bits)));
    ASSERT_OK_AND_ASSIGN(std::vector<StepReport> run, Train(*quantized));
    const Quantizable counts = CountQuantizable(quantized->step_graph().graph);
    EXPECT_GT(counts.collectives, 0);
    EXPECT_EQ(counts.quantized, counts.collectives) << "every gather and reduce-scatter";
    // Bytes (the collective counters): the exact run's, its gathers and reduce-scatters at
    // their quantized size.
    for (int r = 0; r < kWorkers; ++r) {
      EXPECT_EQ(run.back().ranks[r].figures.collective_bytes_sent,
                expected.back().ranks[r].figures.collective_bytes_sent - exact_counts.f32_bytes +
                    counts.planned_bytes)
          << "rank " << r;
    }
    const double bf16 = static_cast<double>(counts.f32_bytes) / 2;
    const double share = static_cast<double>(counts.planned_bytes) / bf16;
    RecordProperty(fmt::format("int{}_bytes_over_bf16", bits), std::to_string(share));
    EXPECT_NEAR(share * (16.0 / bits), 1.0, 0.02) << counts.planned_bytes << " bytes";
    // Losses: within 1% of the exact run's at every step, and not the same (it did quantize).
    for (size_t i = 0; i < run.size(); ++i) {
      ASSERT_TRUE(std::isfinite(run[i].loss)) << "step " << i + 1;
      EXPECT_NEAR(run[i].loss, expected[i].loss, 0.01 * expected[i].loss) << "step " << i + 1;
    }
    EXPECT_NE(run.back().loss, expected.back().loss);
    RecordProperty(fmt::format("int{}_final_loss", bits),
                   fmt::format("{} against {}", run.back().loss, expected.back().loss));
  }
}

TEST_F(QuantizedZero3Test, PlansThatCannotQuantizeAreRefusedByName) {
  TrainingPlan zero2 = Zero3Plan(8);
  zero2.parallel.zero_stage = 2;
  Result<std::unique_ptr<Trainer>> refused = Distributed(zero2);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("use --zero-stage 3"));
  TrainingPlan odd = Zero3Plan(6);
  refused = Distributed(odd);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("6-bit quantization does not exist"));
}

}  // namespace
}  // namespace tessera::testing
