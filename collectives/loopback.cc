#include "collectives/loopback.h"

#include <cstring>

namespace tessera {

class LoopbackGroup::Transport final : public PeerTransport {
 public:
  Transport(LoopbackGroup& group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_.size_; }

  Result<RequestId> Isend(int peer, uint64_t tag, const void* data, int64_t bytes) override {
    TESSERA_RETURN_IF_ERROR(CheckRequest(peer, tag));
    const char* begin = static_cast<const char*>(data);
    {
      MutexLock lock(&group_.mutex_);
      group_.mailboxes_[static_cast<size_t>(peer)][{rank_, tag}].emplace_back(begin, begin + bytes);
    }
    group_.delivered_.NotifyAll();
    return next_++;  // a send completes at once (its bytes are copied)
  }

  Result<RequestId> Irecv(int peer, uint64_t tag, void* data, int64_t bytes) override {
    TESSERA_RETURN_IF_ERROR(CheckRequest(peer, tag));
    const RequestId id = next_++;
    receives_[id] = Receive{peer, tag, data, bytes};
    return id;
  }

  Status Wait(const std::vector<RequestId>& requests, Clock::time_point deadline) override {
    MutexLock lock(&group_.mutex_);
    for (RequestId id : requests) {
      if (!broken_.ok()) break;
      auto it = receives_.find(id);
      if (it == receives_.end()) continue;  // a send, complete already
      const Receive receive = it->second;
      auto& box = group_.mailboxes_[static_cast<size_t>(rank_)];
      const auto key = std::make_pair(receive.peer, receive.tag);
      auto has_message = [&] { return box.contains(key) && !box[key].empty(); };
      auto first_dead = [&]() REQUIRES(group_.mutex_) {
        for (size_t r = 0; r < group_.dead_.size(); ++r) {
          if (group_.dead_[r]) return static_cast<int>(r);
        }
        return -1;
      };
      auto ready = [&]() REQUIRES(group_.mutex_) {
        return has_message() || first_dead() >= 0 || aborted_;
      };
      // As std::condition_variable::wait_until with a predicate: false when the deadline
      // passed with nothing ready.
      bool woke = true;
      while (!ready()) {
        if (!group_.delivered_.WaitUntil(&group_.mutex_, deadline)) {
          woke = ready();
          break;
        }
      }
      if (aborted_) {
        Break(abort_reason_);
      } else if (has_message()) {
        receives_.erase(it);
        Message message = std::move(box[key].front());
        box[key].erase(box[key].begin());
        if (static_cast<int64_t>(message.size()) != receive.bytes) {
          Break(Internal("rank {} sent {} bytes under tag {}, rank {} expected {}", receive.peer,
                         message.size(), receive.tag, rank_, receive.bytes));
        } else if (!message.empty()) {
          std::memcpy(receive.data, message.data(), message.size());
        }
      } else if (first_dead() >= 0) {
        Break(Unavailable("rank {} died", first_dead()));
      } else if (!woke) {
        Break(TimedOut("rank {} heard nothing from rank {} before the deadline", rank_,
                       receive.peer));
      }
    }
    return broken_;
  }

  void Abort(const Status& reason) override {
    {
      MutexLock lock(&group_.mutex_);
      if (!aborted_) {
        aborted_ = true;
        abort_reason_ = reason;
      }
    }
    group_.delivered_.NotifyAll();
  }

 private:
  struct Receive {
    int peer;
    uint64_t tag;
    void* data;
    int64_t bytes;
  };

  Status CheckRequest(int peer, uint64_t tag) const {
    if (!broken_.ok()) return broken_;
    if (peer < 0 || peer >= size() || peer == rank_) {
      return InvalidArgument("rank {} cannot address rank {} in a group of {}", rank_, peer,
                             size());
    }
    if (tag >= kMaxTag) return InvalidArgument("tag {:#x} does not fit 48 bits", tag);
    return Status::Ok();
  }

  // After a failure every request is dropped (the caller may free its buffers).
  void Break(const Status& reason) {
    broken_ = reason;
    receives_.clear();
  }

  LoopbackGroup& group_;
  const int rank_;
  RequestId next_ = 1;
  std::map<RequestId, Receive> receives_;
  Status broken_;
  bool aborted_ GUARDED_BY(group_.mutex_) = false;
  Status abort_reason_ GUARDED_BY(group_.mutex_);
};

LoopbackGroup::LoopbackGroup(int size)
    : size_(size), mailboxes_(static_cast<size_t>(size)), dead_(static_cast<size_t>(size), false) {
  for (int r = 0; r < size; ++r) transports_.push_back(std::make_unique<Transport>(*this, r));
}

LoopbackGroup::~LoopbackGroup() = default;

PeerTransport& LoopbackGroup::transport(int rank) {
  return *transports_.at(static_cast<size_t>(rank));
}

void LoopbackGroup::Kill(int rank) {
  {
    MutexLock lock(&mutex_);
    dead_[static_cast<size_t>(rank)] = true;
  }
  delivered_.NotifyAll();
}

}  // namespace tessera
