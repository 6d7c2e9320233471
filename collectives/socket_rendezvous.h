// SocketRendezvous: a Rendezvous over sockets, hosted by rank 0.
//
// Rank 0 listens on the address ("host:port", or "unix:/path" on one machine); the other ranks
// connect to it (retrying until the deadline, so start order does not matter) and say which
// rank they are. Rank 0 relays AllGather rounds. The connections stay open as the group's
// liveness signal: a member whose connection drops without saying goodbye (killed, crashed) is
// dead; rank 0 tells every other member which rank it was, and when rank 0 itself disappears
// the others see their connection close. A member that is destroyed normally says goodbye first.
// A member that finds a peer silent past its deadline reports it the same way (ReportFailure),
// so every member fails with the one reason naming the stuck rank.
//
// Wire format: frames of [u32 length][u8 kind][payload], little-endian, on the one connection
// between each member and rank 0.
//
// Thread safety: AllGather from one thread at a time; one background thread reads the sockets.
#pragma once

#include <memory>
#include <string>

#include "collectives/rendezvous.h"

namespace tessera {

struct SocketRendezvousOptions {
  std::string address;  // where rank 0 listens: "host:port" or "unix:/path"
  int rank = 0;
  int size = 1;
  int timeout_ms = 30'000;  // for every member to join
};

// Returns once every rank has joined. InvalidArgument for a bad address, rank or size;
// Unavailable when rank 0 cannot listen; TimedOut naming the missing ranks (or, on rank > 0,
// rank 0's address) when the group is not complete in time.
Result<std::unique_ptr<Rendezvous>> JoinSocketRendezvous(const SocketRendezvousOptions& options);

}  // namespace tessera
