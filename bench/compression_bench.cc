// bench_compression: one rank's arithmetic of 1-bit Adam's compressed all-reduce
// (core/sign_compression.h), without the network, against DeepSpeed's arithmetic in PyTorch on the
// CPU (bench/torch_sign_compression.py) measured side by side.
//
// A call on a buffer of --count f32 elements over --ranks ranks, as one rank does it:
//   worker   the buffer plus its error compressed to `ranks` blocks of signs and a scale each
//   server   this rank's chunk from every rank's block averaged, plus its error, compressed
//   decode   every chunk's served block decoded into the buffer
// One thread, like the worker's communication thread that runs it (the peer: torch with one
// intra-op thread). --rounds rounds, alternating which side goes first; in each, --repeats timed
// calls after --warmup untimed ones; a side's figure is the median of its rounds' medians.
// Prints a table and one JSON line:
//   {"count": N, "ranks": R, "worker_ms": ..., "server_ms": ..., "decode_ms": ...,
//    "total_ms": ..., "gb_per_s": ..., "torch_total_ms": ..., "vs_torch": ...}
// gb_per_s: the buffer's f32 bytes over total_ms. vs_torch above 1: Tessera is faster.
// Default --count: the multinode rig's GPT-2 6 x 384 (tests/multinode/multinode_test.sh onebit).
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "bench/bench_util.h"
#include "core/sign_compression.h"

namespace {

using Clock = std::chrono::steady_clock;
using tessera::bench::Median;

struct Flags {
  int64_t count = 11'104'512;
  int ranks = 4;
  int rounds = 3;
  int repeats = 9;
  int warmup = 2;
  std::string torch = "/usr/bin/python3";
  bool no_torch = false;
};

struct Phases {
  double worker_ms = 0, server_ms = 0, decode_ms = 0, total_ms = 0;
};

double MillisSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// One side's figures: the per-phase medians of its calls.
Phases MedianPhases(const std::vector<Phases>& calls) {
  std::vector<double> worker, server, decode, total;
  for (const Phases& p : calls) {
    worker.push_back(p.worker_ms);
    server.push_back(p.server_ms);
    decode.push_back(p.decode_ms);
    total.push_back(p.total_ms);
  }
  return {Median(worker), Median(server), Median(decode), Median(total)};
}

// Tessera's calls: rank 0's share, the other ranks' blocks prepared from their own buffers.
Phases MeasureTessera(const Flags& flags) {
  const int64_t chunk = tessera::SignChunkElements(flags.count, flags.ranks);
  const int64_t words = tessera::SignBlockWords(chunk);
  const auto n = static_cast<size_t>(flags.count);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> input(n), buffer(n), worker_error(n, 0.f);
  for (float& v : input) v = normal(rng);
  std::vector<float> server_error(static_cast<size_t>(chunk), 0.f);
  // received[r]: rank r's block of chunk 0 (ours first); gathered: every chunk's served block.
  std::vector<uint32_t> sent(static_cast<size_t>(words * flags.ranks));
  std::vector<uint32_t> received(sent.size()), gathered(sent.size());
  {
    std::vector<float> other(n), other_error(n, 0.f);
    for (int r = 1; r < flags.ranks; ++r) {
      for (float& v : other) v = normal(rng);
      tessera::CompressWorkerChunks(other.data(), flags.count, flags.ranks, other_error.data(),
                                    sent.data());
      std::copy_n(sent.data(), words, received.data() + words * r);
    }
  }
  std::vector<Phases> calls;
  for (int i = 0; i < flags.warmup + flags.repeats; ++i) {
    buffer = input;
    Phases p;
    auto start = Clock::now();
    tessera::CompressWorkerChunks(buffer.data(), flags.count, flags.ranks, worker_error.data(),
                                  sent.data());
    p.worker_ms = MillisSince(start);
    std::copy_n(sent.data(), words, received.data());
    start = Clock::now();
    tessera::ServeSignChunk(received.data(), flags.ranks, flags.count, flags.ranks, 0,
                            server_error.data(), gathered.data());
    p.server_ms = MillisSince(start);
    for (int r = 1; r < flags.ranks; ++r) {
      std::copy_n(gathered.data(), words, gathered.data() + words * r);
    }
    start = Clock::now();
    tessera::DecodeSignChunks(gathered.data(), flags.count, flags.ranks, buffer.data());
    p.decode_ms = MillisSince(start);
    p.total_ms = p.worker_ms + p.server_ms + p.decode_ms;
    if (i >= flags.warmup) calls.push_back(p);
  }
  return MedianPhases(calls);
}

// The peer's figures from bench/torch_sign_compression.py; total_ms < 0 when it did not run.
Phases MeasureTorch(const Flags& flags) {
  const std::string script = std::string(TESSERA_SOURCE_DIR) + "/bench/torch_sign_compression.py";
  const std::string out = tessera::bench::Capture(
      fmt::format("{} {} --count {} --ranks {} --repeats {} --warmup {} 2>/dev/null", flags.torch,
                  script, flags.count, flags.ranks, flags.repeats, flags.warmup));
  using tessera::bench::JsonNumber;
  return {JsonNumber(out, "worker_ms"), JsonNumber(out, "server_ms"), JsonNumber(out, "decode_ms"),
          JsonNumber(out, "total_ms")};
}

int Run(const Flags& flags) {
  std::vector<Phases> ours, theirs;
  for (int round = 0; round < flags.rounds; ++round) {
    const bool torch_first = round % 2 == 1;
    for (int side = 0; side < 2; ++side) {
      if ((side == 0) != torch_first) {
        ours.push_back(MeasureTessera(flags));
        continue;
      }
      if (flags.no_torch) continue;
      const Phases peer = MeasureTorch(flags);
      if (peer.total_ms < 0) {
        std::fprintf(stderr,
                     "bench_compression: PyTorch did not run with %s (install python3-torch, or "
                     "pass --no-torch)\n",
                     flags.torch.c_str());
        return 1;
      }
      theirs.push_back(peer);
    }
  }
  const Phases t = MedianPhases(ours);
  const double gb_per_s = static_cast<double>(flags.count) * 4 / (t.total_ms * 1e6);
  fmt::print(
      "{} f32 elements over {} ranks, one rank's share of a call, one thread; medians of {} "
      "rounds of {} calls\n",
      flags.count, flags.ranks, flags.rounds, flags.repeats);
  fmt::print("{:<26}{:>11}{:>11}{:>11}{:>11}\n", "", "worker ms", "server ms", "decode ms",
             "total ms");
  fmt::print("{:<26}{:>11.2f}{:>11.2f}{:>11.2f}{:>11.2f}\n", "tessera", t.worker_ms, t.server_ms,
             t.decode_ms, t.total_ms);
  double torch_total = -1, vs_torch = -1;
  if (!theirs.empty()) {
    const Phases p = MedianPhases(theirs);
    fmt::print("{:<26}{:>11.2f}{:>11.2f}{:>11.2f}{:>11.2f}\n", "torch (DeepSpeed's ops)",
               p.worker_ms, p.server_ms, p.decode_ms, p.total_ms);
    torch_total = p.total_ms;
    vs_torch = p.total_ms / t.total_ms;
    fmt::print("tessera {:.2f}x faster than torch\n", vs_torch);
  }
  fmt::print(
      "{{\"count\": {}, \"ranks\": {}, \"worker_ms\": {:.4g}, \"server_ms\": {:.4g}, "
      "\"decode_ms\": {:.4g}, \"total_ms\": {:.4g}, \"gb_per_s\": {:.4g}, \"torch_total_ms\": "
      "{:.4g}, \"vs_torch\": {:.4g}}}\n",
      flags.count, flags.ranks, t.worker_ms, t.server_ms, t.decode_ms, t.total_ms, gb_per_s,
      torch_total, vs_torch);
  return 0;
}

int Main(int argc, char** argv) {
  Flags flags;
  CLI::App app{
      "One rank's arithmetic of 1-bit Adam's compressed all-reduce, against DeepSpeed's "
      "in PyTorch"};
  app.add_option("--count", flags.count, "f32 elements in the buffer")
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--ranks", flags.ranks, "ranks the call is over")->check(CLI::Range(1, 1024));
  app.add_option("--rounds", flags.rounds, "rounds, alternating which side goes first")
      ->check(CLI::Range(1, 100));
  app.add_option("--repeats", flags.repeats, "timed calls a round")->check(CLI::Range(1, 1000));
  app.add_option("--warmup", flags.warmup, "untimed calls first")->check(CLI::Range(0, 100));
  app.add_option("--torch", flags.torch, "python with PyTorch, for the peer");
  app.add_flag("--no-torch", flags.no_torch, "skip PyTorch");
  CLI11_PARSE(app, argc, argv);
  return Run(flags);
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::bench::RunMain("bench_compression", [&] { return Main(argc, argv); });
}
