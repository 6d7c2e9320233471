// Parameter initialisation (Trainer::InitializeParameters): nanoGPT's distributions, the same
// values whatever the thread count (slots are drawn in parallel chunks, each from its own
// generator), different values for different seeds and for different chunks.
#include <cmath>

#include <gmock/gmock.h>
#include <tbb/global_control.h>

#include "model/gpt2.h"
#include "test_util.h"
#include "training/trainer.h"

namespace tessera::testing {
namespace {

// wte is 8192 x 256 = 2M values: two chunks of 2^20.
const Gpt2Config kConfig{2, 256, 4, 8192, 16};

Result<std::vector<float>> Initialized(uint64_t seed, const std::string& name) {
  TrainingPlan plan;
  plan.batch = 1;
  plan.seq_len = 16;
  TESSERA_ASSIGN_OR_RETURN(auto trainer,
                           Trainer::Create(*BuildGpt2(kConfig), plan, ExecutorOptions{}));
  TESSERA_RETURN_IF_ERROR(trainer->InitializeParameters(seed));
  return trainer->GetParameter(name);
}

struct Moments {
  double mean = 0, std = 0;
};
Moments MomentsOf(const std::vector<float>& values) {
  double sum = 0, squares = 0;
  for (float v : values) sum += v;
  const double mean = sum / static_cast<double>(values.size());
  for (float v : values) squares += (v - mean) * (v - mean);
  return {mean, std::sqrt(squares / static_cast<double>(values.size()))};
}

TEST(TrainerInitTest, NanoGptDistributions) {
  ASSERT_OK_AND_ASSIGN(std::vector<float> wte, Initialized(1, "wte"));
  ASSERT_EQ(wte.size(), 8192u * 256u);
  const Moments m = MomentsOf(wte);
  EXPECT_NEAR(m.mean, 0.0, 1e-4);
  EXPECT_NEAR(m.std, 0.02, 0.02 * 0.01);
  ASSERT_OK_AND_ASSIGN(std::vector<float> proj, Initialized(1, "h.1.proj_w"));
  EXPECT_NEAR(MomentsOf(proj).std, 0.02 / std::sqrt(2.0 * 2), 0.01 * 0.02 / std::sqrt(4.0));
  ASSERT_OK_AND_ASSIGN(std::vector<float> gain, Initialized(1, "h.0.ln1_w"));
  EXPECT_EQ(gain, std::vector<float>(256, 1.0f));
  ASSERT_OK_AND_ASSIGN(std::vector<float> bias, Initialized(1, "h.0.qkv_b"));
  EXPECT_EQ(bias, std::vector<float>(size_t{3} * 256, 0.0f));
}

TEST(TrainerInitTest, TheSameValuesOnOneThreadAsOnMany) {
  ASSERT_OK_AND_ASSIGN(std::vector<float> many, Initialized(3, "wte"));
  std::vector<float> one;
  {
    tbb::global_control single(tbb::global_control::max_allowed_parallelism, 1);
    ASSERT_OK_AND_ASSIGN(one, Initialized(3, "wte"));
  }
  EXPECT_EQ(one, many);
  ASSERT_OK_AND_ASSIGN(std::vector<float> other_seed, Initialized(4, "wte"));
  EXPECT_NE(other_seed, many);
  // The two chunks of wte are not one stream repeated.
  const size_t chunk = size_t{1} << 20;
  EXPECT_FALSE(std::equal(many.begin(), many.begin() + 1000, many.begin() + chunk));
  // Nor are two slots of the same shape.
  ASSERT_OK_AND_ASSIGN(std::vector<float> fc0, Initialized(3, "h.0.fc_w"));
  ASSERT_OK_AND_ASSIGN(std::vector<float> fc1, Initialized(3, "h.1.fc_w"));
  EXPECT_NE(fc0, fc1);
}

// A plan whose host-tier state is more than the process may hold is refused before anything is
// allocated, naming the sizes and what to change (not killed by the kernel mid-step).
TEST(TrainerInitTest, StateLargerThanTheHostMemoryIsRefusedUpFront) {
  TrainingPlan plan;
  plan.batch = 1;
  plan.seq_len = 16;
  ExecutorOptions options;
  // kConfig: ~2.9M parameters, 4 bytes each for parameters and both Adam moments (~33 MiB).
  options.host_memory_bytes = int64_t{16} << 20;
  Result<std::unique_ptr<Trainer>> refused = Trainer::Create(*BuildGpt2(kConfig), plan, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  const std::string message = refused.status().message();
  EXPECT_THAT(message, ::testing::HasSubstr("host memory"));
  EXPECT_THAT(message, ::testing::HasSubstr("params"));
  EXPECT_THAT(message, ::testing::HasSubstr("exp_avg"));
  EXPECT_THAT(message, ::testing::HasSubstr("0.0 GiB is available"));
  options.host_memory_bytes = int64_t{64} << 20;  // room for it
  EXPECT_TRUE(Trainer::Create(*BuildGpt2(kConfig), plan, options).ok());
  // Unset, the limit is what the machine has available: positive on Linux.
  EXPECT_GT(AvailableHostMemoryBytes(), 0);
}

// A batch whose step could never fit (its largest intermediate alone, here the logits, is more
// than the process may hold) is refused up front too, naming the figures and the flags to lower.
TEST(TrainerInitTest, AStepLargerThanTheHostMemoryIsRefusedUpFront) {
  TrainingPlan plan;
  plan.batch = int64_t{1} << 20;  // logits: 2^20 x 16 x 8192 floats, 512 GiB
  plan.seq_len = 16;
  ExecutorOptions options;
  options.host_memory_bytes = int64_t{1} << 30;  // the state (~33 MiB) fits
  Result<std::unique_ptr<Trainer>> refused = Trainer::Create(*BuildGpt2(kConfig), plan, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  const std::string message = refused.status().message();
  EXPECT_THAT(message, ::testing::HasSubstr("a step needs at least"));
  EXPECT_THAT(message, ::testing::HasSubstr("largest intermediate"));
  EXPECT_THAT(message, ::testing::HasSubstr("--batch"));
  EXPECT_THAT(message, ::testing::HasSubstr("1.0 GiB is available"));
}

}  // namespace
}  // namespace tessera::testing
