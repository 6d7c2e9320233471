// One member of a collective group in its own process, for the multi-process tests: joins a
// SocketRendezvous, connects a UCX communicator, and runs the reference suite or a loop of
// checked all-reduces. Prints one line per outcome; exits 0 when everything matched.
#include <cstdio>
#include <cstdlib>
#include <exception>

#include <CLI/CLI.hpp>

#include "collective_suite.h"
#include "collectives/socket_rendezvous.h"
#include "collectives/ucx_communicator.h"
#include "core/run_main.h"

namespace {

// The program. main() reports an exception that escapes it (memory running out, a bug) as an
// error instead of terminating.
int Main(int argc, char** argv) {
  using namespace tessera;
  SocketRendezvousOptions rendezvous_options;
  std::string mode = "suite";
  int64_t large_mb = 0;
  int64_t loop_elements = 1 << 20;
  int timeout_ms = 30'000;
  UcxCommunicatorOptions ucx;
  CLI::App app{"A member of a collective group (for tests)"};
  app.add_option("--rank", rendezvous_options.rank)->required();
  app.add_option("--size", rendezvous_options.size)->required();
  app.add_option("--rendezvous", rendezvous_options.address, "host:port or unix:/path")->required();
  app.add_option("--mode", mode, "suite: every op and dtype; loop: all-reduce until an error")
      ->check(CLI::IsMember({"suite", "loop"}));
  app.add_option("--large-mb", large_mb, "Also run each op at this size (suite)");
  app.add_option("--loop-elements", loop_elements, "f32 elements per all-reduce (loop)");
  app.add_option("--timeout-ms", timeout_ms, "Collective deadline");
  app.add_flag("--network-only", ucx.network_only,
               "TCP only, as between hosts (no shared memory, no single copy)");
  app.add_option("--single-copy-bytes", ucx.single_copy_bytes,
                 "Messages from this size to local peers copy once (0: the host's rule)");
  CLI11_PARSE(app, argc, argv);
  const int rank = rendezvous_options.rank;

  auto fail = [&](const Status& status) {
    std::printf("rank %d: error: %s\n", rank, status.ToString().c_str());
    std::fflush(stdout);
    return 1;
  };
  rendezvous_options.timeout_ms = timeout_ms;
  Result<std::unique_ptr<Rendezvous>> rendezvous = JoinSocketRendezvous(rendezvous_options);
  if (!rendezvous.ok()) return fail(rendezvous.status());
  CommunicatorOptions options;
  options.timeout_ms = timeout_ms;
  Result<std::unique_ptr<Communicator>> communicator =
      ConnectUcxCommunicator(**rendezvous, options, ucx);
  if (!communicator.ok()) return fail(communicator.status());

  if (mode == "suite") {
    testing::CollectiveSuiteOptions suite;
    suite.large_bytes = large_mb << 20;
    Status status = testing::RunCollectiveSuite(**communicator, suite);
    if (!status.ok()) return fail(status);
    std::printf("rank %d: suite passed (%lld bytes sent)\n", rank,
                static_cast<long long>((*communicator)->bytes_sent()));
    return 0;
  }
  std::printf("rank %d: looping\n", rank);
  std::fflush(stdout);
  for (int64_t i = 0;; ++i) {
    Status status = testing::CheckedAllReduce(**communicator, loop_elements);
    if (!status.ok()) return fail(status.WithContext(fmt::format("all-reduce #{}", i)));
  }
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::RunMain("collective_member", [&] { return Main(argc, argv); });
}
