// Batches made ahead of their steps (examples/common/prefetch.h): the batch of step N + 1 is made
// while step N runs, served when asked for, dropped when the loop asks for another step (a
// recovery rewound it), never made past the last step, and a failure to make one is the step's.
#include "examples/common/prefetch.h"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>

#include "test_util.h"

namespace tessera::testing {
namespace {

TEST(PrefetcherTest, TheNextBatchIsMadeAheadAndAnotherStepIsMadeOnTheSpot) {
  std::mutex mutex;
  std::vector<int64_t> made;
  std::set<std::thread::id> threads;
  examples::Prefetcher prefetcher(
      [&](int64_t step) -> Result<std::vector<Tensor>> {
        std::lock_guard lock(mutex);
        made.push_back(step);
        threads.insert(std::this_thread::get_id());
        return std::vector<Tensor>{FloatTensor(Shape{1}, {static_cast<float>(step)})};
      },
      /*last_step=*/5);
  for (int64_t step : {1, 2, 3}) {
    ASSERT_OK_AND_ASSIGN(std::vector<Tensor> batch, prefetcher.Get(step));
    EXPECT_EQ(ToVector(batch[0])[0], static_cast<float>(step));
  }
  EXPECT_EQ(prefetcher.made_ahead(), 2);  // steps 2 and 3
  // A rewind (step 2 again): made now; the batch made ahead for step 4 is dropped.
  ASSERT_OK_AND_ASSIGN(std::vector<Tensor> again, prefetcher.Get(2));
  EXPECT_EQ(ToVector(again[0])[0], 2.0f);
  EXPECT_EQ(prefetcher.made_ahead(), 2);
  for (int64_t step : {3, 4, 5}) ASSERT_OK(prefetcher.Get(step).status());
  EXPECT_EQ(prefetcher.made_ahead(), 5);
  EXPECT_EQ(prefetcher.served(), 7);
  std::lock_guard lock(mutex);
  // 1 on the spot, 2 3 4 ahead, 2 on the spot, 3 4 5 ahead; nothing past the last step.
  EXPECT_EQ(made, (std::vector<int64_t>{1, 2, 3, 4, 2, 3, 4, 5}));
  EXPECT_GE(threads.size(), 2u);  // made ahead on another thread than the loop's
  EXPECT_NE(prefetcher.Summary().find("5 of 7 batches made ahead of their steps"),
            std::string::npos)
      << prefetcher.Summary();
}

TEST(PrefetcherTest, AFailureToMakeABatchIsTheStepsError) {
  examples::Prefetcher prefetcher(
      [](int64_t step) -> Result<std::vector<Tensor>> {
        if (step == 2) return InvalidArgument("case 7 is unreadable");
        return std::vector<Tensor>{};
      },
      10);
  ASSERT_OK(prefetcher.Get(1).status());
  const Status failed = prefetcher.Get(2).status();
  EXPECT_EQ(failed.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(failed.message().find("case 7 is unreadable"), std::string::npos);
  ASSERT_OK(prefetcher.Get(3).status());  // made on the spot: nothing was made ahead after 2
  EXPECT_EQ(prefetcher.made_ahead(), 1);
}

}  // namespace
}  // namespace tessera::testing
