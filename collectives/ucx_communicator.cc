#include "collectives/ucx_communicator.h"

#include "core/transport/ucx_peer_transport.h"

namespace tessera {

Result<std::unique_ptr<Communicator>> ConnectUcxCommunicator(Rendezvous& rendezvous,
                                                             const CommunicatorOptions& options) {
  const auto deadline = Rendezvous::Clock::now() + std::chrono::milliseconds(options.timeout_ms);
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<UcxPeerTransport> transport,
                           UcxPeerTransport::Create(rendezvous.rank(), rendezvous.size()));
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> addresses,
                           rendezvous.AllGather(transport->address(), deadline));
  TESSERA_RETURN_IF_ERROR(transport->Connect(addresses, deadline));
  // The rendezvous may report a death after the communicator is gone: hold it weakly.
  std::weak_ptr<UcxPeerTransport> watched = transport;
  rendezvous.OnMemberFailure([watched](const Status& reason) {
    if (auto alive = watched.lock()) alive->Abort(reason);
  });
  // What this rank finds (a peer silent past the deadline) is news to the others.
  CommunicatorOptions reporting = options;
  reporting.on_failure = [&rendezvous, user = options.on_failure](const Status& reason) {
    rendezvous.ReportFailure(reason);
    if (user) user(reason);
  };
  return MakeHostCommunicator(std::shared_ptr<PeerTransport>(std::move(transport)), reporting);
}

}  // namespace tessera
