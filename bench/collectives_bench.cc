// bench_collectives: the UCX host communicator between worker processes on this machine.
//
// Forks --workers member processes that join one group (a SocketRendezvous on a Unix socket)
// and prints, from rank 0, one `name=value` per line:
//   p2p_gbps               nccl-tests' sendrecv: every rank sends --bytes to its right neighbour
//                          while receiving as much from its left one; bytes / time. The links
//                          as the ring uses them, all busy at once.
//   p2p_single_gbps        one message of --bytes from rank 0 to rank 1, the others idle
//   allreduce_busbw_gbps   all-reduce (sum, f32) of --bytes, as nccl-tests defines bus
//                          bandwidth: bytes / time x 2(n-1)/n, the rate each rank's link carries
//   allreduce_algbw_gbps   bytes / time
//   reduce_scatter_busbw_gbps, all_gather_busbw_gbps   bytes / time x (n-1)/n
//   allreduce_small_us     all-reduce of 1 KiB (the direct algorithm): latency
//   busbw_over_p2p         allreduce_busbw / p2p
// Each figure is the median over --iterations, each timed as the slowest rank's time.
// Then, side by side (unless --no-torch, or PyTorch is missing), bench/torch_gloo_collectives.py
// measures PyTorch's gloo backend the same way, and the ratios follow:
//   allreduce_busbw_vs_torch_gloo, p2p_vs_torch_gloo   (above 1: Tessera is faster)
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <vector>

#include <CLI/CLI.hpp>

#include <fmt/format.h>
#include "bench/bench_util.h"
#include "core/statistics.h"

#include "collectives/socket_rendezvous.h"
#include "collectives/ucx_communicator.h"
#include "core/version.h"

namespace {

using Clock = std::chrono::steady_clock;
using tessera::Communicator;
using tessera::DType;
using tessera::ReduceOp;
using tessera::Status;

struct Flags {
  int workers = 4;
  int64_t bytes = 64 << 20;
  int iterations = 10;
  int64_t chunk_bytes = 0;        // 0: the communicator's default
  int64_t single_copy_bytes = 0;  // 0: the host's rule (ucx_communicator.h)
  bool torch = true;
};

using tessera::bench::Capture;

// The value of `name=` in name=value lines, or a negative number.
double Figure(const std::string& text, const std::string& name) {
  const size_t at = text.find(name + "=");
  if (at == std::string::npos) return -1;
  return std::atof(text.c_str() + at + name.size() + 1);
}

[[noreturn]] void Die(int rank, const Status& status) {
  std::fprintf(stderr, "bench_collectives: rank %d: %s\n", rank, status.ToString().c_str());
  std::exit(1);
}

// Seconds `body` takes on the slowest rank (all ranks agree on the figure), median over runs.
double MedianSeconds(Communicator& comm, int iterations, const std::function<Status()>& body) {
  std::vector<double> times;
  float barrier = 0;
  for (int i = 0; i < iterations + 1; ++i) {
    Status status = comm.AllReduce(&barrier, 1, DType::kF32, ReduceOp::kSum);  // start together
    const Clock::time_point start = Clock::now();
    if (status.ok()) status = body();
    float seconds = std::chrono::duration<float>(Clock::now() - start).count();
    if (status.ok()) status = comm.AllReduce(&seconds, 1, DType::kF32, ReduceOp::kMax);
    if (!status.ok()) Die(comm.rank(), status);
    if (i > 0) times.push_back(seconds);  // the first run warms up (pages, UCX registration)
  }
  return tessera::Median(std::move(times));
}

int RunMember(const Flags& flags, int rank, const std::string& address, int report_fd) {
  tessera::SocketRendezvousOptions rendezvous_options;
  rendezvous_options.address = address;
  rendezvous_options.rank = rank;
  rendezvous_options.size = flags.workers;
  auto rendezvous = tessera::JoinSocketRendezvous(rendezvous_options);
  if (!rendezvous.ok()) Die(rank, rendezvous.status());
  tessera::CommunicatorOptions options;
  if (flags.chunk_bytes > 0) options.chunk_bytes = flags.chunk_bytes;
  tessera::UcxCommunicatorOptions ucx;
  ucx.single_copy_bytes = flags.single_copy_bytes;
  auto connected = tessera::ConnectUcxCommunicator(**rendezvous, options, ucx);
  if (!connected.ok()) Die(rank, connected.status());
  Communicator& comm = **connected;
  const int n = comm.size();
  const int64_t count = flags.bytes / 4;
  std::vector<float> buffer(static_cast<size_t>(count), 1.0f);
  std::vector<float> other(static_cast<size_t>(count), 0.0f);
  const double bytes = static_cast<double>(count) * 4;

  const double p2p = MedianSeconds(comm, flags.iterations, [&] {
    return comm.SendRecv(buffer.data(), count, (rank + 1) % n, other.data(), count,
                         (rank + n - 1) % n, DType::kF32);
  });
  const double p2p_single = MedianSeconds(comm, flags.iterations, [&] {
    if (rank == 0) return comm.Send(buffer.data(), count, DType::kF32, 1);
    if (rank == 1) return comm.Recv(other.data(), count, DType::kF32, 0);
    return Status::Ok();
  });
  const double allreduce = MedianSeconds(comm, flags.iterations, [&] {
    return comm.AllReduce(buffer.data(), count, DType::kF32, ReduceOp::kSum);
  });
  const int64_t block = count / n;
  const double reduce_scatter = MedianSeconds(comm, flags.iterations, [&] {
    return comm.ReduceScatter(buffer.data(), other.data(), block, DType::kF32, ReduceOp::kSum);
  });
  const double all_gather = MedianSeconds(comm, flags.iterations, [&] {
    return comm.AllGather(buffer.data(), other.data(), block, DType::kF32);
  });
  const double small = MedianSeconds(comm, std::max(flags.iterations, 50), [&] {
    return comm.AllReduce(buffer.data(), 256, DType::kF32, ReduceOp::kSum);
  });
  if (rank == 0) {
    const double gb = 1e9;
    const double busbw = bytes / allreduce * 2.0 * (n - 1) / n / gb;
    const double p2p_gbps = bytes / p2p / gb;
    const double block_bytes = static_cast<double>(block) * 4 * n;
    const std::string report = fmt::format(
        "workers={}\nbytes={}\np2p_gbps={:.2f}\np2p_single_gbps={:.2f}\n"
        "allreduce_busbw_gbps={:.2f}\nallreduce_algbw_gbps={:.2f}\nallreduce_ms={:.2f}\n"
        "reduce_scatter_busbw_gbps={:.2f}\nall_gather_busbw_gbps={:.2f}\n"
        "allreduce_small_us={:.1f}\nbusbw_over_p2p={:.2f}\n",
        n, count * 4, p2p_gbps, bytes / p2p_single / gb, busbw, bytes / allreduce / gb,
        allreduce * 1e3, block_bytes / reduce_scatter * (n - 1) / n / gb,
        block_bytes / all_gather * (n - 1) / n / gb, small * 1e6, busbw / p2p_gbps);
    if (::write(report_fd, report.data(), report.size()) < 0) return 1;
  }
  return 0;
}

}  // namespace

static int Main(int argc, char** argv) {
  Flags flags;
  CLI::App app{"UCX host collectives between worker processes: bus bandwidth vs point-to-point"};
  app.set_version_flag("--version", tessera::VersionLine("bench_collectives"));
  app.add_option("--workers", flags.workers, "Member processes")->check(CLI::Range(2, 64));
  app.add_option("--bytes", flags.bytes, "Message size for the bandwidth figures")
      ->check(CLI::Range(int64_t{1} << 10, int64_t{1} << 32));
  app.add_option("--iterations", flags.iterations, "Timed runs per figure (median)")
      ->check(CLI::Range(1, 10000));
  app.add_option("--chunk-bytes", flags.chunk_bytes, "Ring chunk size (default: the library's)");
  app.add_option("--single-copy-bytes", flags.single_copy_bytes,
                 "Messages from this size to local peers copy once (default: the host's rule, "
                 "above 8 KiB where the members outnumber the cores, else from 64 KiB)");
  app.add_flag("!--no-torch", flags.torch, "Skip the side-by-side PyTorch gloo measurement");
  CLI11_PARSE(app, argc, argv);

  const std::string directory =
      (std::filesystem::temp_directory_path() / ("bench_collectives." + std::to_string(getpid())))
          .string();
  std::filesystem::create_directories(directory);
  const std::string address = "unix:" + directory + "/rendezvous.sock";
  std::printf("bench_collectives: %d workers, %lld bytes, %d iterations\n", flags.workers,
              static_cast<long long>(flags.bytes), flags.iterations);
  std::fflush(stdout);
  int report[2];
  if (::pipe(report) != 0) {
    std::perror("pipe");
    return 1;
  }
  std::vector<pid_t> children;
  for (int rank = 0; rank < flags.workers; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      ::close(report[0]);
      _exit(RunMember(flags, rank, address, report[1]));
    }
    if (pid < 0) {
      std::perror("fork");
      return 1;
    }
    children.push_back(pid);
  }
  ::close(report[1]);
  std::string figures;
  char buffer[4096];
  ssize_t n;
  while ((n = ::read(report[0], buffer, sizeof(buffer))) > 0)
    figures.append(buffer, static_cast<size_t>(n));
  ::close(report[0]);
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  std::filesystem::remove_all(directory);
  if (failed > 0) {
    std::fprintf(stderr, "bench_collectives: %d member(s) failed\n", failed);
    return 1;
  }
  std::fputs(figures.c_str(), stdout);
  std::fflush(stdout);
  if (!flags.torch) return 0;
  const std::string script = std::string(TESSERA_SOURCE_DIR) + "/bench/torch_gloo_collectives.py";
  const std::string torch =
      Capture(fmt::format("/usr/bin/python3 {} --workers {} --bytes {} --iterations {} 2>/dev/null",
                          script, flags.workers, flags.bytes, flags.iterations));
  if (torch.empty()) {
    std::printf("torch_gloo=unavailable (install python3-torch, or pass --no-torch)\n");
    return 0;
  }
  std::fputs(torch.c_str(), stdout);
  std::printf(
      "allreduce_busbw_vs_torch_gloo=%.2f\n",
      Figure(figures, "allreduce_busbw_gbps") / Figure(torch, "torch_gloo_allreduce_busbw_gbps"));
  std::printf("p2p_vs_torch_gloo=%.2f\n",
              Figure(figures, "p2p_gbps") / Figure(torch, "torch_gloo_p2p_gbps"));
  return 0;
}

int main(int argc, char** argv) {
  return tessera::bench::RunMain("bench_collectives", [&] { return Main(argc, argv); });
}
