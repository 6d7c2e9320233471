// A communicator for host buffers between processes: the collective algorithms of
// HostCommunicator over a UCX peer transport, set up through a Rendezvous.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/rendezvous.h"
#include "core/transport/ucx_peer_transport.h"

namespace tessera {

// Collective over the rendezvous' ranks: each creates its UCX worker, the worker addresses are
// all-gathered, and every rank connects to every other. When the rendezvous reports a dead
// member, the communicator is aborted: a collective in progress on another rank fails at once
// with the reason naming that member. Errors from UCX or the rendezvous name the rank.
// A group whose ranks are all on this host uses shared memory and single copies unless
// `network_only` (then UCX's network transports carry everything, as between hosts); where more
// of its ranks share a host than it has cores, single copies from a smaller message on
// (kOversubscribedSingleCopyBytes, core/transport/ucx_peer_transport.h).
// REQUIRES: the rendezvous outlives the communicator's use (not its destruction).
struct UcxCommunicatorOptions {
  bool network_only = false;
  // Messages from this size to ranks on this host: single copy. 0: 64 KiB, or
  // kOversubscribedSingleCopyBytes where the group's ranks on this host outnumber its cores.
  int64_t single_copy_bytes = 0;
  // How long a wait polls, yielding between polls, before it sleeps (UcxPeerTransportOptions).
  int spin_microseconds = UcxPeerTransportOptions{}.spin_microseconds;
};
// The single-copy threshold of rank `rank` of a group whose ranks run on `hosts` (one name per
// rank), on a host of `cores` cores: the options' when set; else, where more of the group's ranks
// share the rank's host than it has cores, kOversubscribedSingleCopyBytes (the ranks take turns
// on the cores, and UCX's shared memory beyond its eager size needs both sides running at once);
// else the transport's default. None (the largest int64) for network_only.
int64_t SingleCopyBytesFor(const UcxCommunicatorOptions& ucx, const std::vector<std::string>& hosts,
                           int rank, int cores);

Result<std::unique_ptr<Communicator>> ConnectUcxCommunicator(
    Rendezvous& rendezvous, const CommunicatorOptions& options = {},
    const UcxCommunicatorOptions& ucx = {});

}  // namespace tessera
