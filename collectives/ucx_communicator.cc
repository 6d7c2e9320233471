#include "collectives/ucx_communicator.h"

#include <unistd.h>

#include <algorithm>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "core/transport/ucx_peer_transport.h"

namespace tessera {

int64_t SingleCopyBytesFor(const UcxCommunicatorOptions& ucx, const std::vector<std::string>& hosts,
                           int rank, int cores) {
  if (ucx.network_only) return std::numeric_limits<int64_t>::max();
  if (ucx.single_copy_bytes > 0) return ucx.single_copy_bytes;
  const auto here = std::count(hosts.begin(), hosts.end(), hosts[static_cast<size_t>(rank)]);
  return here > std::max(1, cores) ? kOversubscribedSingleCopyBytes
                                   : UcxPeerTransportOptions{}.single_copy_bytes;
}

Result<std::unique_ptr<Communicator>> ConnectUcxCommunicator(Rendezvous& rendezvous,
                                                             const CommunicatorOptions& options,
                                                             const UcxCommunicatorOptions& ucx) {
  const auto deadline = Rendezvous::Clock::now() + std::chrono::milliseconds(options.timeout_ms);
  // Round 1: where everyone is. A group on one host uses shared memory only.
  char hostname[256] = {};
  ::gethostname(hostname, sizeof(hostname) - 1);
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> hosts,
                           rendezvous.AllGather(hostname, deadline));
  UcxPeerTransportOptions transport_options;
  transport_options.local_only =
      !ucx.network_only &&
      std::all_of(hosts.begin(), hosts.end(), [&](const std::string& h) { return h == hosts[0]; });
  transport_options.network_only = ucx.network_only;
  transport_options.spin_microseconds = ucx.spin_microseconds;
  transport_options.single_copy_bytes =
      SingleCopyBytesFor(ucx, hosts, rendezvous.rank(),
                         static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  // Round 2: the UCX worker addresses.
  TESSERA_ASSIGN_OR_RETURN(
      std::shared_ptr<UcxPeerTransport> transport,
      UcxPeerTransport::Create(rendezvous.rank(), rendezvous.size(), transport_options));
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> addresses,
                           rendezvous.AllGather(transport->address(), deadline));
  TESSERA_RETURN_IF_ERROR(transport->Connect(addresses, deadline));
  // The rendezvous may report a death after the communicator is gone: hold it weakly.
  std::weak_ptr<UcxPeerTransport> watched = transport;
  rendezvous.OnMemberFailure([watched](const Status& reason) {
    if (auto alive = watched.lock()) alive->Abort(reason);
  });
  // What this rank finds (a peer silent past the deadline) goes to the group, whose verdict is
  // what the call reports.
  CommunicatorOptions reporting = options;
  UcxPeerTransport* reporter = transport.get();
  reporting.on_failure = [&rendezvous, reporter, user = options.on_failure](const Status& reason) {
    Status verdict = rendezvous.ReportFailure(reason, reporter->failure_silence_ms(),
                                              reporter->failure_silent_peer());
    return user ? user(verdict) : verdict;
  };
  return MakeHostCommunicator(std::shared_ptr<PeerTransport>(std::move(transport)), reporting);
}

}  // namespace tessera
