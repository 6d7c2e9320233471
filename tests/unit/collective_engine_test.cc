// Two workers' collective engines (worker/collective_engine.h) in one process, on real UCX
// communicators, with the scheduler's CollectiveGroups (scheduler/collective_groups.h) as their
// rendezvous and watcher, relayed in process: how a group's formation ends and starts again.
#include <cmath>
#include <future>
#include <mutex>
#include <thread>
#include <utility>

#include "collectives/compressed.h"
#include "collectives/loopback.h"
#include "core/collective_task.h"
#include "core/rpc/wire.h"
#include "scheduler/collective_groups.h"
#include "scheduler/outbox.h"
#include "test_util.h"
#include "worker/collective_engine.h"

namespace tessera::testing {
namespace {

// The scheduler's side, in process: joins and reports go to CollectiveGroups, its messages to
// the addressed engine. Messages are delivered outside the lock, in the order they were sent.
class Relay final : public Outbox {
 public:
  Relay() : groups_(this, [](WorkerId worker) { return worker.ToString(); }) {}

  void Attach(WorkerId worker, CollectiveEngine* engine) { engines_[worker] = engine; }

  CollectiveEngine::SendToScheduler SenderFor(WorkerId from) {
    return [this, from](capnp::MessageBuilder& message) {
      auto body = message.getRoot<proto::Envelope>().asReader().getBody();
      {
        std::lock_guard lock(mutex_);
        if (body.isCollectiveJoin()) {
          EXPECT_OK(groups_.OnJoin(from, body.getCollectiveJoin()));
        } else if (body.isCollectiveFailed()) {
          EXPECT_OK(
              groups_.OnFailed(from, body.getCollectiveFailed(), CollectiveGroups::Clock::now()));
        }
      }
      DeliverQueued();
    };
  }

  // Outbox: called under mutex_ (from CollectiveGroups); queued for DeliverQueued.
  void Send(WorkerId to, capnp::MessageBuilder& message) override {
    auto copy = std::make_unique<capnp::MallocMessageBuilder>();
    copy->setRoot(message.getRoot<proto::Envelope>().asReader());
    queued_.emplace_back(to, std::move(copy));
  }
  void Disconnect(WorkerId, const Status&) override {}

  uint64_t GroupFor(const std::vector<WorkerId>& members, int channel = 0) {
    std::lock_guard lock(mutex_);
    return groups_.GroupFor(members, channel);
  }
  // The scheduler's abort of the group's current formation (as a failed graph instance does).
  void Abort(uint64_t group, const Status& reason) {
    {
      std::lock_guard lock(mutex_);
      groups_.Abort(group, reason);
    }
    DeliverQueued();
  }

 private:
  void DeliverQueued() {
    std::vector<std::pair<WorkerId, std::unique_ptr<capnp::MallocMessageBuilder>>> messages;
    {
      std::lock_guard lock(mutex_);
      messages.swap(queued_);
    }
    for (auto& [to, message] : messages) {
      auto body = message->getRoot<proto::Envelope>().asReader().getBody();
      CollectiveEngine* engine = engines_.at(to);
      if (body.isCollectivePeers()) engine->OnPeers(body.getCollectivePeers());
      if (body.isCollectiveAbort()) {
        auto abort = body.getCollectiveAbort();
        engine->OnAbort(abort.getGroup(), abort.getEpoch(), rpc::FromWire(abort.getError()));
      }
    }
  }

  std::mutex mutex_;
  CollectiveGroups groups_;
  std::vector<std::pair<WorkerId, std::unique_ptr<capnp::MallocMessageBuilder>>> queued_;
  std::map<WorkerId, CollectiveEngine*> engines_;
};

class CollectiveEngineTest : public ::testing::Test {
 protected:
  CollectiveEngineTest()
      : settings_(ShortTimeouts()),
        first_(settings_, relay_.SenderFor(w1_)),
        second_(settings_, relay_.SenderFor(w2_)) {
    relay_.Attach(w1_, &first_);
    relay_.Attach(w2_, &second_);
    group_ = relay_.GroupFor({w1_, w2_});
  }

  // Rank `rank`'s member, task "<name>.<rank>", of collective 1 of op `op` over `tensors` in
  // place (in `group`: the group's on channel 0 when 0).
  CollectiveMember MemberOf(const std::string& name, const std::string& op, int rank,
                            std::vector<Tensor> tensors, uint64_t group = 0) {
    CollectiveMember member;
    member.task = fmt::format("{}.{}", name, rank);
    member.op = op;
    member.attrs = Attrs{{kCollectiveAttr, int64_t{1}},
                         {kRankAttr, int64_t{rank}},
                         {kGroupSizeAttr, int64_t{2}},
                         {kGroupAttr, static_cast<int64_t>(group == 0 ? group_ : group)},
                         {kPositionAttr, int64_t{0}}};
    member.inputs = tensors;
    member.outputs = std::move(tensors);  // in place
    return member;
  }
  // Rank `rank`'s member of an all_reduce (sum) of 1000 values rank + 1.
  CollectiveMember Member(int rank, const Tensor& values, uint64_t group = 0) {
    CollectiveMember member = MemberOf("sum", "all_reduce", rank, {values}, group);
    member.attrs.Set("reduce", std::string("sum"));
    return member;
  }

  // The all_reduce in instance `instance` on both engines, at the next position of both
  // workers' order; each engine's result, or its error.
  std::vector<Status> AllReduce(uint64_t instance, std::vector<std::vector<float>>* results) {
    const int64_t position = next_position_++;
    std::vector<std::promise<Status>> done(2);
    std::vector<Tensor> outputs;
    CollectiveEngine* engines[] = {&first_, &second_};
    for (int rank = 0; rank < 2; ++rank) {
      Tensor values = FloatTensor({1000}, std::vector<float>(1000, static_cast<float>(rank + 1)));
      outputs.push_back(values);
      engines[rank]->Submit({7, instance}, CollectivePlace{0, position}, Member(rank, values),
                            [&done, rank](const Status& status) { done[rank].set_value(status); });
    }
    std::vector<Status> statuses;
    statuses.reserve(done.size());
    for (auto& one : done) statuses.push_back(one.get_future().get());
    for (CollectiveEngine* engine : engines)
      engine->EndInstance({7, instance}, {{0, position}}, {});
    for (const Tensor& out : outputs) results->push_back(ToVector(out));
    return statuses;
  }

  void ExpectSummed(uint64_t instance) {
    std::vector<std::vector<float>> results;
    for (const Status& status : AllReduce(instance, &results)) ASSERT_OK(status);
    for (const std::vector<float>& result : results) {
      EXPECT_EQ(result, std::vector<float>(1000, 3.0f));
    }
  }

  // A group that does not form fails in 3 s rather than 30 (a failing test ends sooner).
  static Settings ShortTimeouts() {
    Settings settings;
    settings.collective_timeout_ms = 3000;
    return settings;
  }

  int64_t next_position_ = 0;  // both workers' next position in their order of collectives
  Settings settings_;
  Relay relay_;
  const WorkerId w1_{1}, w2_{2};
  CollectiveEngine first_, second_;
  uint64_t group_ = 0;
};

// A failed instance aborts the group after both members' parts of its collective had finished
// (the recovery race: the scheduler's verdict reached a communicator that had run to the end, and
// the replay's collective on the same workers failed with the old instance's error). Both drop
// the formation; the next collective forms the group again and sums.
TEST_F(CollectiveEngineTest, AVerdictAfterTheCollectiveFinishedDropsTheFormationOnEveryMember) {
  ExpectSummed(1);
  EXPECT_EQ(first_.stats().groups_formed, 1);
  relay_.Abort(group_, Unavailable("worker4 died while running its part of graph 7"));
  ExpectSummed(2);
  EXPECT_EQ(first_.stats().groups_formed, 2);
  EXPECT_EQ(second_.stats().groups_formed, 2);
}

// A verdict about a formation the members have replaced since (it was sent before they formed
// the group again, and arrives after) is ignored: the group's collectives go on, unformed again.
TEST_F(CollectiveEngineTest, AVerdictAboutAnOlderEpochIsIgnored) {
  ExpectSummed(1);
  relay_.Abort(group_, Unavailable("instance 1 failed"));
  ExpectSummed(2);  // formed again: epoch 2
  first_.OnAbort(group_, 1, Unavailable("instance 1 failed (late)"));
  second_.OnAbort(group_, 1, Unavailable("instance 1 failed (late)"));
  ExpectSummed(3);
  EXPECT_EQ(first_.stats().groups_formed, 2);
  EXPECT_EQ(second_.stats().groups_formed, 2);
  // One about the current epoch still counts.
  first_.OnAbort(group_, 2, Unavailable("a member died"));
  second_.OnAbort(group_, 2, Unavailable("a member died"));
  ExpectSummed(4);
  EXPECT_EQ(first_.stats().groups_formed, 3);
}

// One member joined a formation the other never started (its part of the failed instance had
// not reached the collective). The verdict about that formation tells the other member too, so
// both form the group again at the same, later epoch (a member that stayed behind would join an
// epoch the scheduler had moved past, and its peer would wait for it until the deadline).
TEST_F(CollectiveEngineTest, AVerdictAboutAFormationAMemberNeverJoinedMovesItsEpochOn) {
  std::promise<Status> cut_short;
  first_.Submit({7, 1}, CollectivePlace{0, 0},
                Member(0, FloatTensor({1000}, std::vector<float>(1000, 1.0f))),
                [&](const Status& status) { cut_short.set_value(status); });
  // first_ joins epoch 1 and waits for second_, which has no part of instance 1 yet.
  ASSERT_TRUE(Eventually([&] { return first_.InProgress().forming; }));
  first_.EndInstance({7, 1}, {{0, 0}}, Unavailable("instance 1 failed"));
  EXPECT_FALSE(cut_short.get_future().get().ok());
  second_.EndInstance({7, 1}, {{0, 0}}, Unavailable("instance 1 failed"));  // its member never came
  next_position_ = 1;
  relay_.Abort(group_, Unavailable("instance 1 failed"));
  ExpectSummed(2);  // both form at epoch 2
  EXPECT_EQ(first_.stats().groups_formed, 1);
  EXPECT_EQ(second_.stats().groups_formed, 1);
}

// After a member of an instance failed, the instance's later members fail at once: none starts a
// formation the other members (whose parts are being cancelled) will never join, which would also
// leave this worker's epoch of the group ahead of theirs.
TEST_F(CollectiveEngineTest, AFailedInstancesLaterMembersFailWithoutFormingTheGroup) {
  std::promise<Status> placeholder, later;
  first_.Submit({7, 1}, CollectivePlace{0, 0}, CollectiveMember{},
                [&](const Status& s) { placeholder.set_value(s); });
  first_.Submit({7, 1}, CollectivePlace{0, 1},
                Member(0, FloatTensor({1000}, std::vector<float>(1000, 1.0f))),
                [&](const Status& s) { later.set_value(s); });
  EXPECT_EQ(placeholder.get_future().get().code(), StatusCode::kCancelled);
  EXPECT_EQ(later.get_future().get().code(), StatusCode::kCancelled);
  for (CollectiveEngine* engine : {&first_, &second_}) {
    engine->EndInstance({7, 1}, {{0, 0}, {0, 1}}, Cancelled("instance 1 failed"));
  }
  next_position_ = 2;
  ExpectSummed(2);  // formed once, at the same epoch on both
  EXPECT_EQ(first_.stats().groups_formed, 1);
  EXPECT_EQ(second_.stats().groups_formed, 1);
}

// One order per worker, across instances: a member runs only after every earlier position has run
// or passed, whichever instance it belongs to; an instance that ends passes the positions it never
// submitted (a member whose task never became ready).
TEST_F(CollectiveEngineTest, MembersRunInTheWorkersOneOrderAcrossInstances) {
  std::promise<Status> early_done;
  // Instance 2's member (position 1) comes first; it waits for position 0 (instance 1's).
  first_.Submit({7, 2}, CollectivePlace{0, 1},
                Member(0, FloatTensor({1000}, std::vector<float>(1000, 1.0f))),
                [&](const Status& s) { early_done.set_value(s); });
  std::future<Status> early = early_done.get_future();
  EXPECT_EQ(early.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout)
      << "position 1 ran before position 0";
  EXPECT_TRUE(first_.InProgress().task.empty());
  // Instance 1 ends without ever submitting its member: position 0 passes on both workers, and
  // instance 2's all-reduce runs once second_'s member (position 1 there too) comes.
  for (CollectiveEngine* engine : {&first_, &second_}) {
    engine->EndInstance({7, 1}, {{0, 0}}, Cancelled("instance 1 was cancelled"));
  }
  std::promise<Status> other_done;
  second_.Submit({7, 2}, CollectivePlace{0, 1},
                 Member(1, FloatTensor({1000}, std::vector<float>(1000, 2.0f))),
                 [&](const Status& s) { other_done.set_value(s); });
  EXPECT_OK(early.get());
  EXPECT_OK(other_done.get_future().get());
  next_position_ = 2;
  ExpectSummed(3);
}

// A compressed all-reduce member (1-bit Adam's) runs on the group's communicator as the
// collective does on loopback threads: the same average, worker and server errors, bit for bit,
// over two calls with the errors carried; error buffers of the wrong size are refused on every
// member before any byte moves.
TEST_F(CollectiveEngineTest, ACompressedMemberComputesTheCollectivesBitsAndKeepsItsErrors) {
  constexpr int64_t kCount = 1000;
  const int64_t chunk = SignChunkElements(kCount, 2);
  std::vector<std::vector<float>> inputs(2), worker(2), server(2);
  for (int rank = 0; rank < 2; ++rank) {
    for (int64_t i = 0; i < kCount; ++i) {
      inputs[rank].push_back(std::sin(static_cast<float>(i * (rank + 2))) + 0.1f * rank);
    }
    worker[rank].assign(kCount, 0.f);
    server[rank].assign(static_cast<size_t>(chunk), 0.f);
  }
  // Runs one call on both engines with `tensors` per rank; their statuses.
  const auto run = [&](std::vector<std::vector<Tensor>> tensors) {
    const int64_t position = next_position_++;
    std::vector<std::promise<Status>> done(2);
    CollectiveEngine* engines[] = {&first_, &second_};
    for (int rank = 0; rank < 2; ++rank) {
      engines[rank]->Submit({9, static_cast<uint64_t>(position)}, CollectivePlace{0, position},
                            MemberOf("momentum", "compressed_all_reduce", rank, tensors[rank]),
                            [&done, rank](const Status& status) { done[rank].set_value(status); });
    }
    std::vector<Status> statuses;
    statuses.reserve(done.size());
    for (auto& one : done) statuses.push_back(one.get_future().get());
    for (CollectiveEngine* engine : engines) {
      engine->EndInstance({9, static_cast<uint64_t>(position)}, {{0, position}}, {});
    }
    return statuses;
  };
  // The reference: the collective itself on loopback threads, from the same state.
  LoopbackGroup loopback(2);
  std::vector<std::vector<float>> ref_worker = worker, ref_server = server;
  for (int call = 0; call < 2; ++call) {
    std::vector<std::vector<float>> expected = inputs;
    std::vector<std::thread> threads;
    threads.reserve(2);
    for (int rank = 0; rank < 2; ++rank) {
      threads.emplace_back([&, rank] {
        auto communicator = MakeHostCommunicator(loopback.transport(rank));
        EXPECT_OK(CompressedAllReduce(*communicator, expected[rank].data(), kCount,
                                      ref_worker[rank].data(), ref_server[rank].data()));
      });
    }
    for (std::thread& thread : threads) thread.join();

    std::vector<std::vector<Tensor>> tensors(2);
    for (int rank = 0; rank < 2; ++rank) {
      tensors[rank] = {FloatTensor({kCount}, inputs[rank]), FloatTensor({kCount}, worker[rank]),
                       FloatTensor({chunk}, server[rank])};
    }
    for (const Status& status : run(tensors)) ASSERT_OK(status);
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(ToVector(tensors[rank][0]), expected[rank]) << "call " << call;
      worker[rank] = ToVector(tensors[rank][1]);
      server[rank] = ToVector(tensors[rank][2]);
      EXPECT_EQ(worker[rank], ref_worker[rank]) << "call " << call;
      EXPECT_EQ(server[rank], ref_server[rank]) << "call " << call;
    }
  }
  std::vector<std::vector<Tensor>> wrong(2);
  for (int rank = 0; rank < 2; ++rank) {
    wrong[rank] = {FloatTensor({kCount}, inputs[rank]), FloatTensor({kCount}, worker[rank]),
                   FloatTensor({kCount}, std::vector<float>(kCount, 0.f))};
  }
  // Each member refuses its own (the second may hear the group's verdict on the first first).
  int refused = 0;
  for (const Status& status : run(wrong)) {
    EXPECT_FALSE(status.ok());
    refused += status.code() == StatusCode::kInvalidArgument &&
               status.message().find("server error of 512 elements") != std::string::npos;
  }
  EXPECT_GE(refused, 1);
}

// Channels run at once: with channel 0's first collective waiting for a member that has not
// come (its peer's part is still computing), channel 1's collective of the same workers runs to
// the end on both, over a group of its own; then channel 0's completes. (One order for all would
// make channel 1's wait behind channel 0's: ZeRO-3's backward gathers behind the reductions.)
TEST_F(CollectiveEngineTest, ChannelsProgressWhileAnotherChannelWaits) {
  const uint64_t gathers = relay_.GroupFor({w1_, w2_}, kGatherChannel);
  ASSERT_NE(gathers, group_);
  std::promise<Status> first_reduce, second_reduce;
  Tensor first_values = FloatTensor({1000}, std::vector<float>(1000, 1.0f));
  first_.Submit({7, 1}, CollectivePlace{0, 0}, Member(0, first_values),
                [&](const Status& s) { first_reduce.set_value(s); });
  std::vector<std::promise<Status>> gathered(2);
  std::vector<Tensor> gather_values;
  CollectiveEngine* engines[] = {&first_, &second_};
  for (int rank = 0; rank < 2; ++rank) {
    gather_values.push_back(
        FloatTensor({1000}, std::vector<float>(1000, static_cast<float>(10 * (rank + 1)))));
    engines[rank]->Submit({7, 1}, CollectivePlace{kGatherChannel, 0},
                          Member(rank, gather_values.back(), gathers),
                          [&gathered, rank](const Status& s) { gathered[rank].set_value(s); });
  }
  for (auto& one : gathered) {
    auto result = one.get_future();
    ASSERT_EQ(result.wait_for(std::chrono::seconds(10)), std::future_status::ready)
        << "channel 1 waited behind channel 0";
    EXPECT_OK(result.get());
  }
  for (const Tensor& out : gather_values) EXPECT_EQ(ToVector(out), std::vector<float>(1000, 30.0f));
  std::future<Status> first_reduced = first_reduce.get_future();
  EXPECT_EQ(first_reduced.wait_for(std::chrono::milliseconds(0)),
            std::future_status::timeout);  // still waiting for its peer
  Tensor second_values = FloatTensor({1000}, std::vector<float>(1000, 2.0f));
  second_.Submit({7, 1}, CollectivePlace{0, 0}, Member(1, second_values),
                 [&](const Status& s) { second_reduce.set_value(s); });
  EXPECT_OK(first_reduced.get());
  EXPECT_OK(second_reduce.get_future().get());
  EXPECT_EQ(ToVector(first_values), std::vector<float>(1000, 3.0f));
  EXPECT_EQ(first_.stats().groups_formed, 2);  // one per channel
  for (CollectiveEngine* engine : engines) {
    engine->EndInstance({7, 1}, {{0, 0}, {kGatherChannel, 0}}, {});
  }
}

// A member on a channel the worker does not have is refused, naming it; nothing else waits.
TEST_F(CollectiveEngineTest, AMemberOnAnUnknownChannelIsRefused) {
  std::promise<Status> refused;
  first_.Submit({7, 1}, CollectivePlace{kCollectiveChannels, 0},
                Member(0, FloatTensor({4}, std::vector<float>(4, 1.0f))),
                [&](const Status& s) { refused.set_value(s); });
  const Status status = refused.get_future().get();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("channel 4"), std::string::npos) << status.ToString();
  ExpectSummed(1);
}

// An input whose last reader is a member is freed before the member's `done` says it ran (or was
// refused): the run's next task may allocate as soon as `done` returns, and the plan counts the
// input gone by then (the engine's thread once dropped it a moment later, so a step's peak rose
// by one exchanged buffer now and then on a loaded machine).
TEST_F(CollectiveEngineTest, AMembersOnlyReferenceToItsInputIsDroppedBeforeItsDone) {
  const auto allocator = std::make_shared<AlignedHostAllocator>();
  const auto block = [&](int64_t n, float value) {
    Result<Tensor> made = Tensor::Empty(TensorMeta{Shape{n}, DType::kF32}, allocator);
    EXPECT_OK(made.status());
    std::fill_n(made->data<float>(), n, value);
    return *made;
  };
  std::vector<Tensor> gathered;
  std::vector<std::promise<int64_t>> live_at_done(2);
  CollectiveEngine* engines[] = {&first_, &second_};
  for (int rank = 0; rank < 2; ++rank) {
    gathered.push_back(block(2000, 0.0f));
    CollectiveMember member = MemberOf("gather", "all_gather", rank, {});
    member.inputs = {block(1000, static_cast<float>(rank + 1))};  // its only reference
    member.outputs = {gathered.back()};
    engines[rank]->Submit({7, 1}, CollectivePlace{0, 0}, std::move(member),
                          [&, rank](const Status& status) {
                            EXPECT_OK(status);
                            live_at_done[rank].set_value(allocator->stats().live_bytes);
                          });
  }
  // Both outputs live, and whichever input the other engine has not finished with yet.
  const int64_t outputs = int64_t{2} * 2000 * 4, input = int64_t{1000} * 4;
  const int64_t first = live_at_done[0].get_future().get();
  const int64_t second = live_at_done[1].get_future().get();
  EXPECT_LE(first, outputs + input);
  EXPECT_LE(second, outputs + input);
  EXPECT_EQ(std::min(first, second), outputs) << "the later member's done saw both inputs freed";
  for (CollectiveEngine* engine : engines) engine->EndInstance({7, 1}, {{0, 0}}, {});
  std::vector<float> expected(2000, 1.0f);
  std::fill(expected.begin() + 1000, expected.end(), 2.0f);
  for (const Tensor& out : gathered) EXPECT_EQ(ToVector(out), expected);

  // A member refused at once lets go of its input before its `done` as well.
  std::promise<int64_t> refused_live;
  CollectiveMember refused = MemberOf("refused", "all_gather", 0, {});
  refused.inputs = {block(1000, 1.0f)};
  refused.outputs = {gathered[0]};
  first_.Submit({7, 2}, CollectivePlace{kCollectiveChannels, 0}, std::move(refused),
                [&](const Status& status) {
                  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
                  refused_live.set_value(allocator->stats().live_bytes);
                });
  EXPECT_EQ(refused_live.get_future().get(), outputs);
}

// A stopping worker cancels its instances, which wait for their members: ending an instance
// fails its queued members at once even after Stop (a worker once hung at exit waiting for a
// member that only the engine's destructor, after the instances, would have failed).
TEST_F(CollectiveEngineTest, EndingAnInstanceWhileStoppingFailsItsQueuedMembers) {
  std::promise<Status> queued;
  first_.Submit({7, 1}, CollectivePlace{kGatherChannel, 1},
                Member(0, FloatTensor({4}, std::vector<float>(4, 1.0f))),
                [&](const Status& s) { queued.set_value(s); });  // waits for position 0
  first_.Stop();
  first_.EndInstance({7, 1}, {{kGatherChannel, 0}, {kGatherChannel, 1}},
                     Cancelled("worker stopping"));
  auto result = queued.get_future();
  ASSERT_EQ(result.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_EQ(result.get().code(), StatusCode::kCancelled);
}

}  // namespace
}  // namespace tessera::testing
