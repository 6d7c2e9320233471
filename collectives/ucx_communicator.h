// A communicator for host buffers between processes: the collective algorithms of
// HostCommunicator over a UCX peer transport, set up through a Rendezvous.
#pragma once

#include <memory>

#include "collectives/communicator.h"
#include "collectives/rendezvous.h"

namespace tessera {

// Collective over the rendezvous' ranks: each creates its UCX worker, the worker addresses are
// all-gathered, and every rank connects to every other. When the rendezvous reports a dead
// member, the communicator is aborted: a collective in progress on another rank fails at once
// with the reason naming that member. Errors from UCX or the rendezvous name the rank.
// A group whose ranks are all on this host uses shared memory and single copies unless
// `network_only` (then UCX's network transports carry everything, as between hosts).
// REQUIRES: the rendezvous outlives the communicator's use (not its destruction).
struct UcxCommunicatorOptions {
  bool network_only = false;
};
Result<std::unique_ptr<Communicator>> ConnectUcxCommunicator(
    Rendezvous& rendezvous, const CommunicatorOptions& options = {},
    const UcxCommunicatorOptions& ucx = {});

}  // namespace tessera
