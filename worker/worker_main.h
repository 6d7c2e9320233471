// The worker process: `tessera worker ...` runs one in the foreground. `tessera start` and
// drivers' local clusters (launcher/session.h) launch it with these flags.
//
// RunWorkerProcess reads the cluster token, builds the op registry (the CPU kernels, and the
// GPU's when --gpu names one: opened once, kept across rejoins), and runs a WorkerService
// (worker_service.h). A worker that loses its scheduler tries to join one at the same address
// (a restarted one) for scheduler_grace_ms, as a fresh worker: everything it held went with the
// old scheduler. Then it exits, so a cluster whose scheduler is gone leaves no process holding
// memory. SIGINT or SIGTERM end it at once (a worker holds nothing worth flushing).
#pragma once

#include <cstdint>
#include <string>

namespace CLI {
class App;
}

namespace tessera {

struct WorkerProcessFlags {
  std::string address;     // the scheduler's HOST:PORT; empty: the latest session's
  std::string token_file;  // empty: the latest session's
  int threads = 0;         // 0: one per core
  std::string cpus;        // --cpus: the CPUs it runs on ("0-3,8"); empty: wherever it may
  int64_t host_memory_mb = 4096;
  double host_cap_gib = 0;  // the allocator's cap on the worker's host memory; 0: none
  std::string spill_dir;
  int gpu = -1;  // the GPU this worker owns; -1: a CPU worker
  double gpu_memory_gib = 0;
};

// Adds the `worker` subcommand and its flags to `app`; returns it. `flags` must outlive parsing.
CLI::App* AddWorkerCommand(CLI::App& app, WorkerProcessFlags& flags);

// Runs the worker until it is told to stop or gives up on its scheduler; the exit code.
int RunWorkerProcess(const WorkerProcessFlags& flags);

}  // namespace tessera
