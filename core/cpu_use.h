// How much CPU this process uses: its CPU time (user + system, from getrusage) and, between two
// samples, how many cores it kept busy. A worker reports both with its heartbeat (`tessera
// status`, the dashboard's workers table, /metrics tessera_worker_cpu_seconds_total).
//
// Thread safety: a CpuMeter is used from one thread (the worker's io thread).
#pragma once

#include <chrono>

namespace tessera {

struct CpuUse {
  double seconds = 0;     // this process's CPU time so far, every thread
  double cores_busy = 0;  // CPU time over wall time since the previous sample (0 at the first)
};

// This process's CPU time so far, in seconds (0 if the kernel cannot say).
double ProcessCpuSeconds();

class CpuMeter {
 public:
  CpuUse Sample();

 private:
  double last_seconds_ = -1;
  std::chrono::steady_clock::time_point last_wall_;
};

}  // namespace tessera
