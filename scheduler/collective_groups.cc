#include "scheduler/collective_groups.h"

#include <algorithm>

#include <capnp/message.h>

#include "core/logging.h"
#include "core/rpc/wire.h"

namespace tessera {

uint64_t CollectiveGroups::GroupFor(const std::vector<WorkerId>& members) {
  auto it = keys_.find(members);
  if (it != keys_.end()) return it->second;
  const uint64_t key = next_key_++;
  keys_.emplace(members, key);
  groups_[key].members = members;
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
    group.rounds.clear();
    group.verdict = Status::Ok();
    group.reports.clear();
    group.window_end.reset();
  } else if (join.getEpoch() < group.epoch) {
    return Status::Ok();  // a late join from a formation that was abandoned
  }
  auto& slots = group.rounds[join.getRound()];
  slots.resize(group.members.size());
  const auto blob = join.getBlob();
  slots[static_cast<size_t>(rank)] = std::string(blob.begin(), blob.end());
  if (!std::all_of(slots.begin(), slots.end(), [](const auto& s) { return s.has_value(); })) {
    return Status::Ok();
  }
  for (WorkerId member : group.members) {
    capnp::MallocMessageBuilder message;
    auto peers = message.initRoot<proto::Envelope>().initBody().initCollectivePeers();
    peers.setGroup(join.getGroup());
    peers.setEpoch(group.epoch);
    peers.setRound(join.getRound());
    auto blobs = peers.initBlobs(static_cast<unsigned>(slots.size()));
    for (unsigned i = 0; i < slots.size(); ++i) {
      blobs.set(
          i, kj::arrayPtr(reinterpret_cast<const kj::byte*>(slots[i]->data()), slots[i]->size()));
    }
    outbox_->Send(member, message);
  }
  group.rounds.erase(join.getRound());
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
  if (!group.verdict.ok()) return Status::Ok();  // decided already; the reporter has it
  const Status reason = rpc::FromWire(failed.getError());
  group.reports.push_back(
      Report{reason.ok() ? Unavailable("a member failed") : reason,
             now - std::chrono::milliseconds(std::max<int64_t>(0, failed.getSilentMs()))});
  if (!group.window_end) group.window_end = now + verdict_window_;
  return Status::Ok();
}

void CollectiveGroups::WorkerDied(WorkerId worker, const Status& reason) {
  for (auto& [key, group] : groups_) {
    auto member = std::find(group.members.begin(), group.members.end(), worker);
    if (member == group.members.end() || !group.verdict.ok()) continue;
    // A death is certain: no window.
    Decide(key, group,
           Unavailable("{} (rank {} of collective group {}) died: {}", describe_(worker),
                       member - group.members.begin(), key, reason.message()));
  }
}

void CollectiveGroups::Abort(uint64_t key, const Status& reason) {
  auto it = groups_.find(key);
  if (it == groups_.end() || !it->second.verdict.ok()) return;
  Decide(key, it->second, reason);
}

void CollectiveGroups::Tick(Clock::time_point now) {
  for (auto& [key, group] : groups_) {
    if (!group.window_end || now < *group.window_end || !group.verdict.ok()) continue;
    // A member starved by the stuck one went silent later than the stuck one did.
    const Status first = std::min_element(group.reports.begin(), group.reports.end(),
                                          [](const Report& a, const Report& b) {
                                            return a.silent_since < b.silent_since;
                                          })
                             ->reason;
    Decide(key, group, first);  // a copy: Decide clears the reports
  }
}

void CollectiveGroups::Decide(uint64_t key, Group& group, const Status& verdict) {
  group.verdict = verdict;
  group.reports.clear();
  group.window_end.reset();
  GetLogger("scheduler")->warn("collective group {} failed: {}", key, verdict.ToString());
  for (WorkerId member : group.members) {
    capnp::MallocMessageBuilder message;
    auto abort = message.initRoot<proto::Envelope>().initBody().initCollectiveAbort();
    abort.setGroup(key);
    rpc::ToWire(verdict, abort.initError());
    outbox_->Send(member, message);
  }
}

}  // namespace tessera
