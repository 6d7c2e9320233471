// Idle spinning: a thread that runs out of work looks for more for a short while, yielding its
// core to any other runnable thread between looks, before it sleeps.
//
// Why: a handoff to a sleeping thread costs a wake-up, and waking a core that went idle costs
// far more than the handoff (on a virtual machine the idle vCPU halts, and the host must
// schedule it again: tens of microseconds). A task's round trip is a chain of such handoffs
// (driver, scheduler, worker, its executor, and back), so each hop that finds its next thread
// still looking saves one. Yielding (not pausing) keeps the cost low where cores are few: a
// spinning thread gives way to whichever thread has work. The `idle_spin_us` setting bounds it;
// 0 sleeps at once.
#pragma once

#include <chrono>
#include <thread>

namespace tessera {

// Calls `ready()` until it returns true or `spin` has passed, yielding between calls; returns
// its last answer.
template <typename Ready>
bool SpinUntil(std::chrono::microseconds spin, Ready&& ready) {
  if (ready()) return true;
  if (spin.count() <= 0) return false;
  const auto deadline = std::chrono::steady_clock::now() + spin;
  while (std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
    if (ready()) return true;
  }
  return false;
}

}  // namespace tessera
