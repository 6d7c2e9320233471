// LoopbackGroup: a group of ranks inside one process (one thread per rank), for tests of the
// collective algorithms without a network. A send copies the bytes into the receiver's mailbox
// at once; a receive completes when a message with its (source, tag) is there.
//
// Kill(rank) simulates a dead member as the group's watcher (the scheduler, a rendezvous) reports
// it: every rank's wait fails with Unavailable naming the dead rank.
//
// Thread safety: each rank's transport is used by its own thread; Kill from any thread. The
// mailboxes and the dead ranks are shared, under the group's mutex.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "core/thread_annotations.h"
#include "core/transport/peer_transport.h"

namespace tessera {

class LoopbackGroup {
 public:
  explicit LoopbackGroup(int size);
  ~LoopbackGroup();
  // The transport of `rank` (owned by the group).
  PeerTransport& transport(int rank);
  void Kill(int rank);

 private:
  class Transport;
  using Message = std::vector<char>;
  friend class Transport;

  const int size_;
  Mutex mutex_;
  CondVar delivered_;
  // Per receiving rank: (source, tag) -> messages in arrival order.
  std::vector<std::map<std::pair<int, uint64_t>, std::vector<Message>>> mailboxes_
      GUARDED_BY(mutex_);
  std::vector<bool> dead_ GUARDED_BY(mutex_);
  std::vector<std::unique_ptr<Transport>> transports_;
};

}  // namespace tessera
