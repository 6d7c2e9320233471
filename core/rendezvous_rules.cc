#include "core/rendezvous_rules.h"

#include <algorithm>
#include <set>

namespace tessera {

std::optional<std::vector<std::string>> GatherRounds::Contribute(uint32_t round, int rank,
                                                                 std::string blob) {
  TESSERA_CHECK(rank >= 0 && rank < size_, "rank {} of a group of {}", rank, size_);
  auto& slots = rounds_[round];
  slots.resize(static_cast<size_t>(size_));
  slots[static_cast<size_t>(rank)] = std::move(blob);
  if (!std::all_of(slots.begin(), slots.end(), [](const auto& s) { return s.has_value(); })) {
    return std::nullopt;
  }
  std::vector<std::string> all;
  all.reserve(slots.size());
  for (auto& slot : slots) {
    if (slot) all.push_back(std::move(*slot));  // every one has a value (above)
  }
  rounds_.erase(round);
  return all;
}

std::vector<int> GatherRounds::Missing(uint32_t round) const {
  std::vector<int> missing;
  auto it = rounds_.find(round);
  for (int r = 0; r < size_; ++r) {
    if (it == rounds_.end() || !it->second[static_cast<size_t>(r)]) missing.push_back(r);
  }
  return missing;
}

void FailureVerdict::Report(int reporter, int silent_peer, const Status& reason, int64_t silent_ms,
                            Clock::time_point now) {
  if (decided()) return;
  reports_.push_back(SilentPeer{reporter, silent_peer,
                                reason.ok() ? Unavailable("a member failed") : reason,
                                now - std::chrono::milliseconds(std::max<int64_t>(0, silent_ms))});
  if (!window_end_) window_end_ = now + window_;
}

bool FailureVerdict::Decide(const Status& reason) {
  if (decided()) return false;
  verdict_ = reason.ok() ? Unavailable("a member failed") : reason;
  reports_.clear();
  window_end_.reset();
  return true;
}

bool FailureVerdict::DecideIfDue(Clock::time_point now) {
  if (decided() || !window_end_ || now < *window_end_ || reports_.empty()) return false;
  // A member that reported is alive: reports blaming one are set aside (when others remain).
  std::set<int> reporters;
  for (const SilentPeer& report : reports_) {
    if (report.reporter >= 0) reporters.insert(report.reporter);
  }
  std::vector<const SilentPeer*> standing;
  for (const SilentPeer& report : reports_) {
    if (report.silent_peer < 0 || !reporters.contains(report.silent_peer)) {
      standing.push_back(&report);
    }
  }
  if (standing.empty()) {
    for (const SilentPeer& report : reports_) standing.push_back(&report);
  }
  const Status first = (*std::min_element(standing.begin(), standing.end(),
                                          [](const SilentPeer* a, const SilentPeer* b) {
                                            return a->silent_since < b->silent_since;
                                          }))
                           ->reason;
  return Decide(first);  // a copy: Decide clears the reports
}

void FailureVerdict::Reset() {
  verdict_ = Status::Ok();
  reports_.clear();
  window_end_.reset();
}

}  // namespace tessera
