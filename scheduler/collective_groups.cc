#include "scheduler/collective_groups.h"

#include <algorithm>

#include <capnp/message.h>

#include "core/logging.h"
#include "core/rpc/frame.h"
#include "core/rpc/wire.h"

namespace tessera {

uint64_t CollectiveGroups::GroupFor(const std::vector<WorkerId>& members, int channel) {
  auto it = keys_.find({members, channel});
  if (it != keys_.end()) return it->second;
  const uint64_t key = next_key_++;
  keys_.emplace(std::make_pair(members, channel), key);
  groups_.emplace(key, Group(members, verdict_window_));
  return key;
}

const std::vector<WorkerId>* CollectiveGroups::Members(uint64_t group) const {
  auto it = groups_.find(group);
  return it == groups_.end() ? nullptr : &it->second.members;
}

Status CollectiveGroups::OnJoin(WorkerId from, proto::CollectiveJoin::Reader join) {
  auto it = groups_.find(join.getGroup());
  if (it == groups_.end()) {
    return InvalidArgument("{} joined collective group {}, which does not exist", from.ToString(),
                           join.getGroup());
  }
  Group& group = it->second;
  const int rank = join.getRank();
  if (rank < 0 || rank >= static_cast<int>(group.members.size()) ||
      group.members[static_cast<size_t>(rank)] != from ||
      join.getSize() != static_cast<int>(group.members.size())) {
    return InvalidArgument("{} joined collective group {} as rank {} of {}, which it is not",
                           from.ToString(), join.getGroup(), rank, join.getSize());
  }
  if (join.getEpoch() > group.epoch) {
    // The members form the group anew (after a failure): forget the old exchange and verdict.
    group.epoch = join.getEpoch();
    group.rounds.Clear();
    group.verdict.Reset();
  } else if (join.getEpoch() < group.epoch) {
    return Status::Ok();  // a late join from a formation that was abandoned
  }
  for (size_t r = 0; r < group.members.size(); ++r) {
    if (!dead_.contains(group.members[r])) continue;
    if (group.verdict.Decide(
            Unavailable("{} (rank {} of collective group {}) is dead: the group cannot form again",
                        describe_(group.members[r]), r, join.getGroup()))) {
      SendVerdict(join.getGroup(), group);
    } else {
      // Decided when another member joined this epoch: this one may have been at the old
      // epoch then (and ignored it), so it gets the verdict now.
      SendVerdictTo(from, join.getGroup(), group);
    }
    return Status::Ok();
  }
  const auto blob = join.getBlob();
  std::optional<std::vector<std::string>> all =
      group.rounds.Contribute(join.getRound(), rank, std::string(blob.begin(), blob.end()));
  if (!all) return Status::Ok();
  for (WorkerId member : group.members) {
    rpc::ScopedMessageBuilder message;
    auto peers = message.initRoot<proto::Envelope>().initBody().initCollectivePeers();
    peers.setGroup(join.getGroup());
    peers.setEpoch(group.epoch);
    peers.setRound(join.getRound());
    auto blobs = peers.initBlobs(static_cast<unsigned>(all->size()));
    for (unsigned i = 0; i < all->size(); ++i) {
      const std::string& one = (*all)[i];
      blobs.set(i, kj::arrayPtr(reinterpret_cast<const kj::byte*>(one.data()), one.size()));
    }
    outbox_->Send(member, message);
  }
  return Status::Ok();
}

Status CollectiveGroups::OnFailed(WorkerId from, proto::CollectiveFailed::Reader failed,
                                  Clock::time_point now) {
  auto it = groups_.find(failed.getGroup());
  if (it == groups_.end()) {
    return InvalidArgument("{} reported a failure of collective group {}, which does not exist",
                           from.ToString(), failed.getGroup());
  }
  Group& group = it->second;
  const auto member = std::find(group.members.begin(), group.members.end(), from);
  if (member == group.members.end()) {
    return InvalidArgument(
        "{} reported a failure of collective group {}, of which it is not a member",
        from.ToString(), failed.getGroup());
  }
  if (failed.getEpoch() != group.epoch) return Status::Ok();  // about a formation gone by
  const int size = static_cast<int>(group.members.size());
  const int silent_peer =
      failed.getSilentPeer() >= 0 && failed.getSilentPeer() < size ? failed.getSilentPeer() : -1;
  group.verdict.Report(static_cast<int>(member - group.members.begin()), silent_peer,
                       rpc::FromWire(failed.getError()), failed.getSilentMs(), now);
  return Status::Ok();
}

void CollectiveGroups::WorkerDied(WorkerId worker, const Status& reason) {
  dead_.insert(worker);
  for (auto& [key, group] : groups_) {
    auto member = std::find(group.members.begin(), group.members.end(), worker);
    if (member == group.members.end()) continue;
    // A death is certain: no window.
    if (group.verdict.Decide(Unavailable("{} (rank {} of collective group {}) died: {}",
                                         describe_(worker), member - group.members.begin(), key,
                                         reason.message()))) {
      SendVerdict(key, group);
    }
  }
}

void CollectiveGroups::Abort(uint64_t key, const Status& reason) {
  auto it = groups_.find(key);
  if (it != groups_.end() && it->second.verdict.Decide(reason)) SendVerdict(key, it->second);
}

void CollectiveGroups::Tick(Clock::time_point now) {
  for (auto& [key, group] : groups_) {
    if (group.verdict.DecideIfDue(now)) SendVerdict(key, group);
  }
}

void CollectiveGroups::SendVerdict(uint64_t key, const Group& group) {
  GetLogger("scheduler")
      ->warn("collective group {} (epoch {}) failed: {}", key, group.epoch,
             group.verdict.verdict().ToString());
  for (WorkerId member : group.members) SendVerdictTo(member, key, group);
}

void CollectiveGroups::SendVerdictTo(WorkerId member, uint64_t key, const Group& group) {
  rpc::ScopedMessageBuilder message;
  auto abort = message.initRoot<proto::Envelope>().initBody().initCollectiveAbort();
  abort.setGroup(key);
  abort.setEpoch(group.epoch);
  rpc::ToWire(group.verdict.verdict(), abort.initError());
  outbox_->Send(member, message);
}

std::vector<WorkerId> CollectiveGroups::MissingJoins(uint64_t key) const {
  std::vector<WorkerId> missing;
  auto found = groups_.find(key);
  if (found == groups_.end()) return missing;
  const Group& group = found->second;
  std::optional<uint32_t> round = group.rounds.OpenRound();
  if (!round.has_value()) return missing;
  for (int rank : group.rounds.Missing(*round)) {
    missing.push_back(group.members.at(static_cast<size_t>(rank)));
  }
  return missing;
}

}  // namespace tessera
