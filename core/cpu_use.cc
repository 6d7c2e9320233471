#include "core/cpu_use.h"

#include <sys/resource.h>

#include <algorithm>

namespace tessera {

double ProcessCpuSeconds() {
  rusage use{};
  if (::getrusage(RUSAGE_SELF, &use) != 0) return 0;
  const auto seconds = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6;
  };
  return seconds(use.ru_utime) + seconds(use.ru_stime);
}

CpuUse CpuMeter::Sample() {
  const auto now = std::chrono::steady_clock::now();
  CpuUse use{.seconds = ProcessCpuSeconds()};
  if (last_seconds_ >= 0) {
    const double wall = std::chrono::duration<double>(now - last_wall_).count();
    if (wall > 0) use.cores_busy = std::max(0.0, use.seconds - last_seconds_) / wall;
  }
  last_seconds_ = use.seconds;
  last_wall_ = now;
  return use;
}

}  // namespace tessera
