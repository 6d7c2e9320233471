#include "core/pending_connections.h"

#include <algorithm>
#include <cerrno>

#include "core/settings.h"
#include "core/status.h"

namespace tessera {

PendingLimits PendingLimits::FromSettings(const Settings& settings) {
  return PendingLimits{
      .deadline_ms = std::max<int64_t>(1, settings.preauth_deadline_ms),
      .max_pending = static_cast<int>(std::max<int64_t>(1, settings.preauth_max_pending)),
      .max_pending_per_address =
          static_cast<int>(std::max<int64_t>(1, settings.preauth_max_pending_per_address))};
}

std::vector<uint64_t> PendingConnections::Add(uint64_t id, std::string address,
                                              Clock::time_point now) {
  TESSERA_CHECK(!by_id_.contains(id), "connection {} is already pending", id);
  std::vector<uint64_t> evicted;
  // Room for the newcomer: first among its address's connections, then among all.
  auto same = by_address_.find(address);
  while (same != by_address_.end() &&
         static_cast<int>(same->second.size()) >= std::max(1, limits_.max_pending_per_address)) {
    const uint64_t oldest = same->second.begin()->second;
    Erase(oldest);  // may erase `same` when it held the last one
    evicted.push_back(oldest);
    same = by_address_.find(address);
  }
  while (static_cast<int>(by_id_.size()) >= std::max(1, limits_.max_pending)) {
    const uint64_t oldest = by_age_.begin()->second;
    Erase(oldest);
    evicted.push_back(oldest);
  }
  const uint64_t order = next_order_++;
  by_age_.emplace(order, id);
  by_address_[address].emplace(order, id);
  by_id_.emplace(id, Entry{std::move(address), now, order});
  return evicted;
}

void PendingConnections::Remove(uint64_t id) {
  if (by_id_.contains(id)) Erase(id);
}

std::vector<uint64_t> PendingConnections::TakeExpired(Clock::time_point now) {
  std::vector<uint64_t> expired;
  const auto deadline = std::chrono::milliseconds(limits_.deadline_ms);
  // Oldest first: stop at the first one still within its deadline.
  while (!by_age_.empty()) {
    const uint64_t id = by_age_.begin()->second;
    if (now - by_id_.at(id).accepted < deadline) break;
    Erase(id);
    expired.push_back(id);
  }
  return expired;
}

std::optional<uint64_t> PendingConnections::TakeOldest() {
  if (by_age_.empty()) return std::nullopt;
  const uint64_t id = by_age_.begin()->second;
  Erase(id);
  return id;
}

void PendingConnections::Erase(uint64_t id) {
  auto it = by_id_.find(id);
  TESSERA_CHECK(it != by_id_.end(), "connection {} is not pending", id);
  by_age_.erase(it->second.order);
  auto address = by_address_.find(it->second.address);
  address->second.erase(it->second.order);
  if (address->second.empty()) by_address_.erase(address);
  by_id_.erase(it);
}

bool AcceptOutOfResources(int error_number) {
  return error_number == EMFILE || error_number == ENFILE || error_number == ENOBUFS ||
         error_number == ENOMEM;
}

std::string PendingConnections::AddressOf(std::string_view peer) {
  const size_t colon = peer.rfind(':');
  if (colon == std::string_view::npos || colon + 1 == peer.size()) return std::string(peer);
  const std::string_view port = peer.substr(colon + 1);
  if (!std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::string(peer);
  }
  std::string_view host = peer.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return std::string(host);
}

}  // namespace tessera
