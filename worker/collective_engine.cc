#include "worker/collective_engine.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "collectives/compressed.h"
#include "collectives/quantized.h"
#include "collectives/rendezvous.h"
#include "collectives/ucx_communicator.h"
#include "core/collective_task.h"
#include "core/logging.h"
#include "core/rpc/frame.h"
#include "core/rpc/wire.h"
#include "core/timeline.h"
#include "worker/task_runner.h"

namespace tessera {

namespace {

// Reports within this window of the first are weighed together by the scheduler; a member
// waits a little longer than that for the verdict.
constexpr auto kVerdictWait = std::chrono::milliseconds(2500);

Result<ReduceOp> ParseReduce(const Attrs& attrs) {
  TESSERA_ASSIGN_OR_RETURN(std::string name, attrs.GetString("reduce"));
  if (name == "sum") return ReduceOp::kSum;
  if (name == "avg") return ReduceOp::kAvg;
  if (name == "max") return ReduceOp::kMax;
  if (name == "min") return ReduceOp::kMin;
  return InvalidArgument("attribute 'reduce' is '{}'; use sum, avg, max or min", name);
}

// An all-to-all in the layout attribute "layout" says (core/exchange_layout.h): the blocks sent
// from the sequence order are gathered first, and the blocks received for it placed after, in
// host staging of the block order.
Status AllToAllInLayout(Communicator& communicator, const Tensor& in, const Tensor& out,
                        const Attrs& attrs, int size) {
  TESSERA_ASSIGN_OR_RETURN(ExchangeLayout layout, ExchangeLayoutOf(attrs));
  if (RotatesRing(layout)) {
    // One send and one receive of the whole buffer: to the next member and from the previous
    // (kRingNext), or the other way round.
    if (size < 2) {
      return InvalidArgument("a ring rotation ({}) needs a group of 2 or more members, not {}",
                             ExchangeLayoutName(layout), size);
    }
    const int rank = communicator.rank();
    const int next = (rank + 1) % size, previous = (rank + size - 1) % size;
    const bool forward = layout == ExchangeLayout::kRingNext;
    return communicator.SendRecv(in.raw_data(), in.numel(), forward ? next : previous,
                                 out.raw_data(), out.numel(), forward ? previous : next,
                                 in.dtype());
  }
  if (PassesHalo(layout)) {
    // Along the line of members: to the next and from the previous (kHaloNext), or the other
    // way round; an end without a sender receives zeros, one without a receiver sends nothing.
    const int rank = communicator.rank();
    const bool forward = layout == ExchangeLayout::kHaloNext;
    const int to = forward ? rank + 1 : rank - 1, from = forward ? rank - 1 : rank + 1;
    const bool sends = to >= 0 && to < size, receives = from >= 0 && from < size;
    if (!receives) std::memset(out.raw_data(), 0, static_cast<size_t>(out.bytes()));
    if (sends && receives) {
      return communicator.SendRecv(in.raw_data(), in.numel(), to, out.raw_data(), out.numel(), from,
                                   in.dtype());
    }
    if (sends) return communicator.Send(in.raw_data(), in.numel(), in.dtype(), to);
    if (receives) return communicator.Recv(out.raw_data(), out.numel(), in.dtype(), from);
    return Status::Ok();
  }
  if (in.numel() % size != 0) {
    return InvalidArgument(
        "all-to-all of {} elements: not a multiple of the group's {} members (pad the input)",
        in.numel(), size);
  }
  const int64_t block = in.numel() / size;
  if (layout == ExchangeLayout::kBlocks) {
    return communicator.AllToAll(in.raw_data(), out.raw_data(), block, in.dtype());
  }
  // The sequence side's dims [B, P S, ...]: out's for kToSequence, in's for kFromSequence.
  const Tensor& sequence = layout == ExchangeLayout::kToSequence ? out : in;
  const std::vector<int64_t>& dims = sequence.shape().dims();
  if (dims.size() < 2 || dims[1] % size != 0) {
    return InvalidArgument("all-to-all in layout {}: shape {} does not split over {} members",
                           ExchangeLayoutName(layout), sequence.shape().ToString(), size);
  }
  const int64_t batch = dims[0], positions = dims[1] / size;
  const int64_t row_bytes = sequence.bytes() / (batch * dims[1]);
  std::vector<char> staging(static_cast<size_t>(in.bytes()));
  if (layout == ExchangeLayout::kToSequence) {
    TESSERA_RETURN_IF_ERROR(
        communicator.AllToAll(in.raw_data(), staging.data(), block, in.dtype()));
    MoveSequenceBlocks(out.raw_data(), staging.data(), size, batch, positions, row_bytes,
                       /*to_sequence=*/true);
    return Status::Ok();
  }
  MoveSequenceBlocks(in.raw_data(), staging.data(), size, batch, positions, row_bytes,
                     /*to_sequence=*/false);
  return communicator.AllToAll(staging.data(), out.raw_data(), block, in.dtype());
}

// A reduce-scatter (`gather` false) or all-gather along the sequence (attribute layout
// "sequence", core/exchange_layout.h): the sequence side [B, S, ...] (the reduce-scatter's in, the
// all-gather's out) moved to or from the block order [size, B, S / size, ...] in host staging.
Status SequenceSplitCollective(Communicator& communicator, const Tensor& in, const Tensor& out,
                               const Attrs& attrs, int size, bool gather) {
  const Tensor& sequence = gather ? out : in;
  const std::vector<int64_t>& dims = sequence.shape().dims();
  if (dims.size() < 2 || dims[1] % size != 0 ||
      sequence.numel() != size * (gather ? in : out).numel()) {
    return InvalidArgument("{} along the sequence: shapes {} and {} do not split over {} members",
                           gather ? "all-gather" : "reduce-scatter", in.shape().ToString(),
                           out.shape().ToString(), size);
  }
  const int64_t batch = dims[0], positions = dims[1] / size;
  const int64_t row_bytes = batch * dims[1] == 0 ? 0 : sequence.bytes() / (batch * dims[1]);
  std::vector<char> staging(static_cast<size_t>(sequence.bytes()));
  if (gather) {
    TESSERA_RETURN_IF_ERROR(
        communicator.AllGather(in.raw_data(), staging.data(), in.numel(), in.dtype()));
    MoveSequenceBlocks(out.raw_data(), staging.data(), size, batch, positions, row_bytes,
                       /*to_sequence=*/true);
    return Status::Ok();
  }
  TESSERA_ASSIGN_OR_RETURN(ReduceOp op, ParseReduce(attrs));
  MoveSequenceBlocks(in.raw_data(), staging.data(), size, batch, positions, row_bytes,
                     /*to_sequence=*/false);
  return communicator.ReduceScatter(staging.data(), out.raw_data(), out.numel(), out.dtype(), op);
}

}  // namespace

// The scheduler as a Rendezvous for one formation (epoch) of one group.
class CollectiveEngine::SchedulerRendezvous final : public Rendezvous {
 public:
  SchedulerRendezvous(uint64_t group, uint32_t epoch, int rank, int size, SendToScheduler send)
      : group_(group), epoch_(epoch), rank_(rank), size_(size), send_(std::move(send)) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  uint32_t epoch() const { return epoch_; }

  Result<std::vector<std::string>> AllGather(const std::string& mine,
                                             Clock::time_point deadline) override {
    const uint32_t round = next_round_++;
    rpc::ScopedMessageBuilder message;
    auto join = message.initRoot<proto::Envelope>().initBody().initCollectiveJoin();
    join.setGroup(group_);
    join.setEpoch(epoch_);
    join.setRound(round);
    join.setRank(rank_);
    join.setSize(size_);
    join.setBlob(kj::arrayPtr(reinterpret_cast<const kj::byte*>(mine.data()), mine.size()));
    send_(message);
    MutexLock lock(&mutex_);
    while (!results_.contains(round) && failure_.ok() && changed_.WaitUntil(&mutex_, deadline)) {
    }
    if (auto it = results_.find(round); it != results_.end()) {
      std::vector<std::string> all = std::move(it->second);
      results_.erase(it);
      return all;
    }
    if (!failure_.ok()) return failure_;
    return TimedOut(
        "collective group {} did not form: not every member joined in time (is a member's "
        "worker stuck or gone?)",
        group_);
  }

  void OnMemberFailure(FailureHandler on_failure) override {
    Status known;
    {
      MutexLock lock(&mutex_);
      handler_ = on_failure;
      known = failure_;
    }
    if (!known.ok()) on_failure(known);
  }

  Status ReportFailure(const Status& reason, int64_t silent_ms, int silent_peer) override {
    {
      MutexLock lock(&mutex_);
      if (!failure_.ok()) return failure_;
    }
    rpc::ScopedMessageBuilder message;
    auto failed = message.initRoot<proto::Envelope>().initBody().initCollectiveFailed();
    failed.setGroup(group_);
    rpc::ToWire(reason, failed.initError());
    failed.setSilentMs(silent_ms);
    failed.setSilentPeer(silent_peer);
    failed.setEpoch(epoch_);
    send_(message);
    MutexLock lock(&mutex_);
    const auto until = std::chrono::steady_clock::now() + kVerdictWait;
    while (failure_.ok() && changed_.WaitUntil(&mutex_, until)) {
    }
    return failure_.ok() ? reason : failure_;
  }

  void Deliver(uint32_t round, std::vector<std::string> blobs) {
    MutexLock lock(&mutex_);
    results_[round] = std::move(blobs);
    changed_.NotifyAll();
  }

  // The scheduler's verdict: the group's collectives fail with it.
  void Fail(const Status& verdict) {
    FailureHandler handler;
    {
      MutexLock lock(&mutex_);
      if (!failure_.ok()) return;
      failure_ = verdict;
      handler = handler_;
      changed_.NotifyAll();
    }
    if (handler) handler(verdict);
  }

 private:
  const uint64_t group_;
  const uint32_t epoch_;
  const int rank_;
  const int size_;
  SendToScheduler send_;
  uint32_t next_round_ = 0;
  Mutex mutex_;
  CondVar changed_;
  std::map<uint32_t, std::vector<std::string>> results_ GUARDED_BY(mutex_);
  Status failure_ GUARDED_BY(mutex_);
  FailureHandler handler_ GUARDED_BY(mutex_);
};

CollectiveEngine::CollectiveEngine(const Settings& settings, SendToScheduler send,
                                   KernelContext copier)
    : settings_(settings), send_(std::move(send)), copier_(std::move(copier)) {}

CollectiveEngine::Lane* CollectiveEngine::LaneFor(int channel) {
  if (stopping_) return nullptr;
  std::unique_ptr<Lane>& lane = lanes_[static_cast<size_t>(channel)];
  if (!lane) {
    lane = std::make_unique<Lane>();
    lane->channel = channel;
    lane->thread = std::thread([this, raw = lane.get()] { Loop(*raw); });
  }
  return lane.get();
}

std::shared_ptr<CollectiveEngine::SchedulerRendezvous> CollectiveEngine::AbortRunning(
    Lane& lane, const Status& reason) {
  auto group = groups_.find(lane.running_group);
  if (lane.running_group == 0 || group == groups_.end()) return nullptr;
  if (group->second.communicator) {
    group->second.communicator->Abort(reason);
    group->second.aborted = true;  // the group forms again next time
    return nullptr;
  }
  return group->second.rendezvous;  // still forming: that stops too
}

void CollectiveEngine::Stop() {
  std::vector<std::shared_ptr<SchedulerRendezvous>> forming;
  {
    MutexLock lock(&mutex_);
    stopping_ = true;
    for (const std::unique_ptr<Lane>& lane : lanes_) {
      if (!lane) continue;
      if (auto rendezvous = AbortRunning(*lane, Cancelled("the worker is stopping"))) {
        forming.push_back(std::move(rendezvous));
      }
    }
  }
  changed_.NotifyAll();
  for (const auto& rendezvous : forming) rendezvous->Fail(Cancelled("the worker is stopping"));
}

CollectiveEngine::~CollectiveEngine() {
  Stop();
  std::vector<Queued> left;
  std::vector<std::thread*> threads;
  {
    MutexLock lock(&mutex_);
    for (const std::unique_ptr<Lane>& lane : lanes_) {
      if (!lane) continue;
      for (auto& [position, queued] : lane->queued) left.push_back(std::move(queued));
      lane->queued.clear();
      threads.push_back(&lane->thread);
    }
  }
  for (std::thread* thread : threads) thread->join();
  for (Queued& queued : left) queued.Finish(Cancelled("the worker is stopping"));
}

void CollectiveEngine::Submit(const InstanceId& instance, CollectivePlace place,
                              CollectiveMember member, Done done) {
  Status refused;
  {
    MutexLock lock(&mutex_);
    Lane* lane = nullptr;
    if (place.channel < 0 || place.channel >= kCollectiveChannels) {
      refused = InvalidArgument("collective member '{}' is on channel {}, not one of 0 .. {}",
                                member.task, place.channel, kCollectiveChannels - 1);
    } else if (lane = LaneFor(place.channel); lane == nullptr) {
      refused = Cancelled("the worker is stopping");
    } else if (auto failed = failed_.find(instance); failed != failed_.end()) {
      refused = failed->second;
      if (place.position >= lane->next) lane->passing.insert(place.position);
      changed_.NotifyAll();
    } else {
      lane->queued.emplace(place.position, Queued{instance, std::move(member), std::move(done)});
      changed_.NotifyAll();
      return;
    }
  }
  Queued{instance, std::move(member), std::move(done)}.Finish(refused);
}

void CollectiveEngine::EndInstance(const InstanceId& instance,
                                   const std::vector<CollectivePlace>& places,
                                   const Status& reason) {
  std::vector<Queued> ended;
  std::vector<std::shared_ptr<SchedulerRendezvous>> forming;
  {
    MutexLock lock(&mutex_);
    failed_.erase(instance);
    for (const CollectivePlace& place : places) {
      if (place.channel < 0 || place.channel >= kCollectiveChannels) continue;
      // Its queued members fail even while stopping (the instance waits for them); a channel
      // not started yet is started only to note the positions that pass.
      Lane* lane = lanes_[static_cast<size_t>(place.channel)].get();
      if (lane == nullptr) lane = LaneFor(place.channel);
      if (lane == nullptr) continue;              // stopping, and nothing of it was queued
      if (place.position < lane->next) continue;  // ran, or passed
      auto queued = lane->queued.find(place.position);
      if (queued != lane->queued.end() && queued->second.instance == instance) {
        ended.push_back(std::move(queued->second));
        lane->queued.erase(queued);
      }
      if (!lane->queued.contains(place.position)) lane->passing.insert(place.position);
    }
    changed_.NotifyAll();
    if (!reason.ok()) {
      // Its collectives in progress: stop them now (the other members are being cancelled too);
      // their groups form again next time.
      for (const std::unique_ptr<Lane>& lane : lanes_) {
        if (!lane || lane->running_group == 0 || lane->running_instance != instance) continue;
        if (auto rendezvous = AbortRunning(*lane, reason)) forming.push_back(std::move(rendezvous));
      }
    }
  }
  for (const auto& rendezvous : forming) rendezvous->Fail(reason);
  const Status why =
      reason.ok() ? Cancelled("the instance ended before this collective ran") : reason;
  for (Queued& queued : ended) queued.Finish(why);
}

void CollectiveEngine::OnPeers(proto::CollectivePeers::Reader peers) {
  std::shared_ptr<SchedulerRendezvous> rendezvous;
  {
    MutexLock lock(&mutex_);
    auto it = groups_.find(peers.getGroup());
    if (it == groups_.end() || !it->second.rendezvous ||
        it->second.rendezvous->epoch() != peers.getEpoch()) {
      return;  // a formation this worker abandoned
    }
    rendezvous = it->second.rendezvous;
  }
  std::vector<std::string> blobs;
  for (capnp::Data::Reader blob : peers.getBlobs()) blobs.emplace_back(blob.begin(), blob.end());
  rendezvous->Deliver(peers.getRound(), std::move(blobs));
}

void CollectiveEngine::OnAbort(uint64_t group, uint32_t epoch, const Status& reason) {
  std::shared_ptr<SchedulerRendezvous> rendezvous;
  std::unique_ptr<Communicator> idle;  // destroyed outside the lock
  {
    MutexLock lock(&mutex_);
    Group& entry = groups_[group];
    if (entry.rendezvous && entry.rendezvous->epoch() > epoch) {
      GetLogger("worker")->info(
          "collective group {}: ignored a verdict about epoch {} (formed as epoch {} since): {}",
          group, epoch, entry.rendezvous->epoch(), reason.ToString());
      return;
    }
    // The next formation comes after the one judged, also where this worker never joined it
    // (its collective had not started): every member then forms the group at the same epoch.
    entry.epoch = std::max(entry.epoch, epoch);
    if (!entry.rendezvous) return;
    rendezvous = entry.rendezvous;
    const bool running = std::any_of(lanes_.begin(), lanes_.end(), [&](const auto& lane) {
      return lane && lane->running_group == group;
    });
    if (running) {
      entry.aborted = true;  // Run drops it when the collective returns
    } else {
      idle = std::move(entry.communicator);
      entry.rendezvous.reset();
    }
  }
  GetLogger("worker")->warn("collective group {} (epoch {}) aborted: {}", group, epoch,
                            reason.ToString());
  rendezvous->Fail(reason);  // aborts the communicator's transport (a collective in progress)
}

CollectiveEngineStats CollectiveEngine::stats() const {
  MutexLock lock(&mutex_);
  return stats_;
}

CollectiveInProgress CollectiveEngine::InProgress() const {
  MutexLock lock(&mutex_);
  CollectiveInProgress longest;
  for (const std::unique_ptr<Lane>& lane : lanes_) {
    if (!lane || lane->in_progress.task.empty()) continue;
    if (longest.task.empty() || lane->in_progress.since < longest.since) {
      longest = lane->in_progress;
    }
  }
  return longest;
}

void CollectiveEngine::Queued::Finish(const Status& status) {
  member.inputs.clear();
  member.outputs.clear();
  done(status);
}

void CollectiveEngine::Loop(Lane& lane) {
  while (true) {
    Queued next;
    {
      MutexLock lock(&mutex_);
      while (!stopping_ && !lane.NextIsDue()) changed_.Wait(&mutex_);
      if (stopping_) return;
      const int64_t position = lane.next++;
      if (lane.passing.erase(position) > 0) continue;
      auto item = lane.queued.find(position);
      next = std::move(item->second);
      lane.queued.erase(item);
      if (auto failed = failed_.find(next.instance); failed != failed_.end()) {
        const Status why = failed->second;
        lock.Unlock();
        next.Finish(why);
        continue;
      }
      lane.running_instance = next.instance;
      lane.running_group = static_cast<uint64_t>(next.member.attrs.GetInt(kGroupAttr, 0));
      const Attrs& attrs = next.member.attrs;
      lane.in_progress =
          CollectiveInProgress{.task = next.member.task,
                               .op = next.member.op,
                               .collective = attrs.GetInt(kCollectiveAttr, 0),
                               .group = lane.running_group,
                               .rank = static_cast<int>(attrs.GetInt(kRankAttr, 0)),
                               .size = static_cast<int>(attrs.GetInt(kGroupSizeAttr, 0)),
                               .forming = false,
                               .since = std::chrono::steady_clock::now()};
    }
    int64_t sent = 0;
    const int64_t started_us = SystemMicrosNow();
    const Status status = Run(lane, next.member, sent);
    const int64_t ended_us = SystemMicrosNow();
    {
      MutexLock lock(&mutex_);
      lane.running_group = 0;
      lane.in_progress = CollectiveInProgress{};
      ++stats_.collectives_run;
      if (!status.ok()) failed_.emplace(lane.running_instance, status);
    }
    if (next.member.on_ran && !next.member.op.empty()) {
      next.member.on_ran(started_us, ended_us, sent);
    }
    next.Finish(status);
  }
}

Result<Communicator*> CollectiveEngine::CommunicatorFor(Lane& lane, uint64_t key, int rank,
                                                        int size) {
  std::shared_ptr<SchedulerRendezvous> rendezvous;
  {
    MutexLock lock(&mutex_);
    if (stopping_) return Cancelled("the worker is stopping");
    Group& group = groups_[key];
    if (group.communicator) {
      if (group.communicator->size() != size || group.communicator->rank() != rank) {
        return Internal(
            "collective group {} is rank {} of {} here, but a member says rank {} of {}", key,
            group.communicator->rank(), group.communicator->size(), rank, size);
      }
      return group.communicator.get();
    }
    group.rendezvous = std::make_shared<SchedulerRendezvous>(key, ++group.epoch, rank, size, send_);
    group.aborted = false;  // about the formation this one replaces
    rendezvous = group.rendezvous;
    lane.in_progress.forming = true;
  }
  CommunicatorOptions options;
  options.timeout_ms = static_cast<int>(settings_.collective_timeout_ms);
  options.chunk_bytes = settings_.collective_chunk_bytes;
  options.small_bytes = settings_.collective_small_bytes;
  UcxCommunicatorOptions ucx;
  ucx.single_copy_bytes = settings_.collective_single_copy_bytes;
  ucx.spin_microseconds = static_cast<int>(settings_.collective_spin_us);
  Result<std::unique_ptr<Communicator>> formed = ConnectUcxCommunicator(*rendezvous, options, ucx);
  MutexLock lock(&mutex_);
  lane.in_progress.forming = false;
  Group& group = groups_[key];
  if (!formed.ok()) {
    group.rendezvous.reset();
    return formed.status().WithContext(fmt::format("forming collective group {}", key));
  }
  group.communicator = std::move(*formed);
  ++stats_.groups_formed;
  GetLogger("worker")->info("formed collective group {} (rank {} of {}, channel {})", key, rank,
                            size, lane.channel);
  return group.communicator.get();
}

Result<std::array<Tensor, 2>> CollectiveEngine::CompressedErrorsOnHost(
    const CollectiveMember& member, const Tensor& out, int64_t count, int size) {
  // The error buffers are updated in place (outputs 1 and 2 hold them); a device's cross the
  // host communicator through host copies, as the value does.
  std::array<Tensor, 2> errors;
  for (size_t e = 0; e < errors.size(); ++e) {
    const Tensor& error = member.outputs.at(e + 1);
    if (error.meta().device.is_cpu()) {
      errors[e] = error;
    } else {
      TESSERA_ASSIGN_OR_RETURN(errors[e], HostCopyOf(error, copier_));
    }
  }
  const int64_t chunk = SignChunkElements(count, size);
  if (out.dtype() != DType::kF32 || errors[0].dtype() != DType::kF32 ||
      errors[1].dtype() != DType::kF32 || errors[0].numel() != out.numel() ||
      errors[1].numel() != chunk) {
    return InvalidArgument(
        "compressed all-reduce '{}': x {}, worker error {} and server error {}, but it takes f32 "
        "x, a worker error as long and a server error of {} elements ({} compressed over {})",
        member.task, out.meta().ToString(), errors[0].meta().ToString(),
        errors[1].meta().ToString(), chunk, count, size);
  }
  return errors;
}

Status CollectiveEngine::Run(Lane& lane, CollectiveMember& member, int64_t& sent) {
  // A placeholder for a member that failed before it got here: its position just passes.
  if (member.op.empty()) return Cancelled("the member failed before its collective");
  const Attrs& attrs = member.attrs;
  TESSERA_ASSIGN_OR_RETURN(int64_t key, attrs.GetInt(kGroupAttr));
  // Rank and group size as CollectiveOf checks them (a rank in the group, a group no larger than
  // kMaxCollectiveGroupSize), never cast from the attributes unchecked.
  TaskSpec as_task;
  as_task.name = member.task;
  as_task.attrs = attrs;
  TESSERA_ASSIGN_OR_RETURN(std::optional<CollectiveMembership> membership, CollectiveOf(as_task));
  if (!membership) {
    return InvalidArgument("collective member '{}' names no collective", member.task);
  }
  const int rank = membership->rank;
  const int size = membership->group_size;
  TESSERA_ASSIGN_OR_RETURN(Communicator * communicator,
                           CommunicatorFor(lane, static_cast<uint64_t>(key), rank, size));
  const int64_t sent_before = communicator->bytes_sent();
  const Tensor& device_out = member.outputs.at(0);
  // Device buffers cross the host communicator through host copies: the input, and the output
  // where it holds the input already (in place, or a broadcast's root); the result goes back.
  const bool staged =
      !device_out.meta().device.is_cpu() || !member.inputs.at(0).meta().device.is_cpu();
  const bool out_holds_input = member.op == "all_reduce" || member.op == "all_gather_in_place" ||
                               member.op == "broadcast" || member.op == "compressed_all_reduce";
  TESSERA_ASSIGN_OR_RETURN(Tensor in, HostCopyOf(member.inputs.at(0), copier_));
  Tensor out = device_out;
  if (staged) {
    if (out_holds_input) {
      TESSERA_ASSIGN_OR_RETURN(out, HostCopyOf(device_out, copier_));
    } else {
      TESSERA_ASSIGN_OR_RETURN(out, Tensor::Empty(OnHost(device_out.meta()), copier_.allocator));
    }
  }
  Status status;
  if (member.op == "all_reduce") {
    TESSERA_ASSIGN_OR_RETURN(ReduceOp op, ParseReduce(attrs));
    status = communicator->AllReduce(out.raw_data(), out.numel(), out.dtype(), op);
  } else if (member.op == "reduce_scatter" || member.op == "all_gather") {
    const bool gather = member.op == "all_gather";
    TESSERA_ASSIGN_OR_RETURN(const bool sequence, SplitsSequence(attrs));
    if (sequence) {
      status = SequenceSplitCollective(*communicator, in, out, attrs, size, gather);
    } else if (attrs.Has(kQuantizeBitsAttr)) {
      // ZeRO++'s quantized weight gather and gradient reduce-scatter.
      const auto bits = static_cast<int>(attrs.GetInt(kQuantizeBitsAttr, 8));
      if (in.dtype() != DType::kF32 || out.dtype() != DType::kF32) {
        return InvalidArgument("quantized {} '{}' of {}: quantized collectives take f32", member.op,
                               member.task, in.meta().ToString());
      }
      status = gather ? QuantizedAllGather(*communicator, in.data<float>(), in.numel(), bits,
                                           out.data<float>())
                      : QuantizedReduceScatter(*communicator, in.data<float>(), out.numel(), bits,
                                               out.data<float>());
    } else if (gather) {
      status = communicator->AllGather(in.raw_data(), out.raw_data(), in.numel(), in.dtype());
    } else {
      TESSERA_ASSIGN_OR_RETURN(ReduceOp op, ParseReduce(attrs));
      status =
          communicator->ReduceScatter(in.raw_data(), out.raw_data(), out.numel(), out.dtype(), op);
    }
  } else if (member.op == "all_gather_in_place") {
    // This member's block is already in place in `out`.
    const int64_t block = out.numel() / size;
    char* base = static_cast<char*>(out.raw_data());
    status = communicator->AllGather(base + rank * block * DTypeSize(out.dtype()), base, block,
                                     out.dtype());
  } else if (member.op == "all_to_all") {
    if (out.numel() != in.numel() || out.dtype() != in.dtype()) {
      return InvalidArgument(
          "all-to-all '{}': input of {} and output of {} elements, but both must hold the same "
          "number of elements of one dtype",
          member.task, in.numel(), out.numel());
    }
    status = AllToAllInLayout(*communicator, in, out, attrs, size);
  } else if (member.op == "broadcast") {
    TESSERA_ASSIGN_OR_RETURN(int64_t root, attrs.GetInt("root"));
    if (root < 0 || root >= size) {
      return InvalidArgument("broadcast '{}': root {} is not a rank of a group of {}", member.task,
                             root, size);
    }
    status =
        communicator->Broadcast(out.raw_data(), out.numel(), out.dtype(), static_cast<int>(root));
  } else if (member.op == "compressed_all_reduce") {
    using HostErrors = std::array<Tensor, 2>;
    TESSERA_ASSIGN_OR_RETURN(const int64_t count, CompressedCount(attrs, out.numel()));
    TESSERA_ASSIGN_OR_RETURN(HostErrors errors, CompressedErrorsOnHost(member, out, count, size));
    status = CompressedAllReduce(*communicator, static_cast<float*>(out.raw_data()), count,
                                 static_cast<float*>(errors[0].raw_data()),
                                 static_cast<float*>(errors[1].raw_data()));
    for (size_t e = 0; e < errors.size() && status.ok(); ++e) {
      const Tensor& error = member.outputs.at(e + 1);
      if (!error.meta().device.is_cpu()) status = CopyTensor(error, errors[e], copier_);
    }
  } else {
    return InvalidArgument("{} is not a collective op", member.op);
  }
  if (status.ok() && staged) status = CopyTensor(device_out, out, copier_);
  sent = communicator->bytes_sent() - sent_before;
  MutexLock lock(&mutex_);
  stats_.bytes_sent += sent;
  Group& group = groups_[static_cast<uint64_t>(key)];
  if (!status.ok() || group.aborted) {
    // The communicator is broken, or aborted as this collective finished (it would fail every
    // later call): the group forms again at its next collective.
    group.communicator.reset();
    group.rendezvous.reset();
    group.aborted = false;
  }
  return status;
}

}  // namespace tessera
