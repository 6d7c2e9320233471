// The object directory (scheduler/object_directory.h) on its own: references, uses, watchers,
// waiting tasks and frees.
#include "scheduler/object_directory.h"

#include <functional>

#include "test_util.h"

namespace tessera::testing {
namespace {

// Records what the directory tells the waiting tasks; may act on it like the task table does.
class RecordingWaiters : public ObjectWaiters {
 public:
  void InputSealed(TaskId task) override {
    sealed.push_back(task);
    if (on_sealed) on_sealed(task);
  }
  void InputFailed(TaskId task, const ObjectSpec& object, const Status& error) override {
    failed.push_back(fmt::format("{} {}: {}", task.ToString(), object.name, error.message()));
    if (on_failed) on_failed(task);
  }

  std::vector<TaskId> sealed;
  std::vector<std::string> failed;
  std::function<void(TaskId)> on_sealed, on_failed;
};

class ObjectDirectoryTest : public ::testing::Test {
 protected:
  static ObjectSpec Spec(uint64_t id) {
    return ObjectSpec{ObjectId(id), fmt::format("o{}", id),
                      TensorMeta{Shape{1}, DType::kF32, Device::Cpu()}, ObjectRole::kActivation,
                      TaskId()};
  }

  RecordingWaiters waiters_;
  ObjectDirectory objects_{&waiters_};
  const WorkerId driver_{1}, worker_{2};
  const ObjectId o1_{1}, o2_{2};
  const TaskId t1_{1}, t2_{2};
};

TEST_F(ObjectDirectoryTest, AnObjectIsFreedOnItsHolderOnceNothingNeedsIt) {
  objects_.Declare(Spec(1), driver_);
  objects_.AddUse(o1_);
  objects_.AddWaiter(o1_, t1_);
  objects_.Watch(driver_, o1_);
  objects_.Seal(o1_, worker_, 4, "");
  EXPECT_EQ(waiters_.sealed, (std::vector<TaskId>{t1_}));
  EXPECT_EQ(objects_.TakeNotifications()[driver_], (std::vector<ObjectId>{o1_}));
  objects_.Release(driver_, o1_);
  objects_.Release(driver_, o1_);  // a second release is ignored
  EXPECT_TRUE(objects_.contains(o1_)) << "a task will still read it";
  objects_.ReleaseUse(o1_);
  EXPECT_FALSE(objects_.contains(o1_));
  EXPECT_EQ(objects_.TakeFrees()[worker_], (std::vector<ObjectId>{o1_}));
  EXPECT_TRUE(objects_.TakeFrees().empty());
}

TEST_F(ObjectDirectoryTest, AWaiterMayFreeTheObjectItWasToldAboutAndItIsFreedOnce) {
  objects_.Declare(Spec(1), driver_);
  objects_.Release(driver_, o1_);  // the driver let go before it was sealed
  objects_.AddUse(o1_);
  objects_.AddWaiter(o1_, t1_);
  waiters_.on_sealed = [&](TaskId) { objects_.ReleaseUse(o1_); };  // the task failed at once
  objects_.Seal(o1_, worker_, 4, "");
  EXPECT_FALSE(objects_.contains(o1_));
  EXPECT_EQ(objects_.TakeFrees()[worker_], (std::vector<ObjectId>{o1_}));

  objects_.Declare(Spec(2), driver_);
  objects_.Release(driver_, o2_);
  for (TaskId task : {t1_, t2_}) {
    objects_.AddUse(o2_);
    objects_.AddWaiter(o2_, task);
  }
  waiters_.on_failed = [&](TaskId) { objects_.ReleaseUse(o2_); };
  objects_.Fail(o2_, Internal("kernel crashed"));
  EXPECT_EQ(waiters_.failed,
            (std::vector<std::string>{"task1 o2: kernel crashed", "task2 o2: kernel crashed"}));
  EXPECT_FALSE(objects_.contains(o2_));
}

TEST_F(ObjectDirectoryTest, ADepartingDriverTakesItsReferencesWatchesAndPuts) {
  objects_.Put(Spec(1), driver_, "");      // held only by the driver
  objects_.Put(Spec(2), driver_, "abcd");  // inline: survives the driver
  objects_.AddUse(o1_);
  objects_.AddUse(o2_);
  objects_.Declare(Spec(3), driver_);
  objects_.Watch(driver_, ObjectId(3));
  objects_.DriverGone(driver_);
  ASSERT_TRUE(objects_.contains(o1_));
  EXPECT_EQ(objects_.Find(o1_)->error.message(), "o1 was lost: the driver that put it exited");
  EXPECT_TRUE(objects_.Find(o2_)->error.ok());
  EXPECT_TRUE(objects_.Find(ObjectId(3))->watchers.empty());
  EXPECT_EQ(objects_.Find(ObjectId(3))->driver_refs, 0);
  objects_.ReleaseUse(o1_);
  objects_.ReleaseUse(o2_);
  EXPECT_FALSE(objects_.contains(o1_));
  EXPECT_FALSE(objects_.contains(o2_));
}

TEST_F(ObjectDirectoryTest, ADeadWorkersOnlyCopiesAreLostButInlineOnesAreNot) {
  objects_.Declare(Spec(1), driver_);
  objects_.Declare(Spec(2), driver_);
  objects_.Declare(Spec(3), driver_);
  objects_.Seal(o1_, worker_, 4, "");
  objects_.Seal(o2_, worker_, 4, "abcd");
  EXPECT_EQ(objects_.WorkerGone(worker_), (std::vector<ObjectId>{o1_}));
  EXPECT_TRUE(objects_.Find(o2_)->holders.empty());
}

TEST_F(ObjectDirectoryTest, WatchingAnUnknownOrFinishedObjectIsAnsweredAtOnce) {
  objects_.Watch(driver_, ObjectId(99));
  objects_.Put(Spec(1), driver_, "abcd");
  objects_.Watch(driver_, o1_);
  EXPECT_EQ(objects_.TakeNotifications()[driver_], (std::vector<ObjectId>{ObjectId(99), o1_}));
  objects_.Watch(WorkerId(7), o1_);
  objects_.DropNotifications(WorkerId(7));
  EXPECT_TRUE(objects_.TakeNotifications().empty());
}

}  // namespace
}  // namespace tessera::testing
