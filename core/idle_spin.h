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
//
// IdleSpinner adapts the spin to the gaps it sees, so that a thread whose work comes seldom (an
// idle cluster's io threads, a worker between training steps) does not spin after every burst
// and take the CPU from others on a shared machine: after a gap longer than the bound, the
// next spin is half as long (down to none); after a gap a full spin would have caught, spins
// are full again.
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

// One thread's idle spinning (not thread-safe: each looping thread owns one).
class IdleSpinner {
 public:
  explicit IdleSpinner(std::chrono::microseconds most) : most_(most), next_(most) {}

  // The thread ran out of work: spins up to the current allowance; true when `ready()` said so
  // (the allowance is full again). On false the caller sleeps, then calls Woke.
  template <typename Ready>
  bool Spin(Ready&& ready) {
    idle_since_ = std::chrono::steady_clock::now();
    if (!SpinUntil(next_, ready)) return false;
    next_ = most_;
    return true;
  }
  // After the sleep that followed a Spin that found nothing.
  void Woke() {
    const auto gap = std::chrono::steady_clock::now() - idle_since_;
    next_ = gap <= most_ ? most_ : next_ / 2;
  }
  std::chrono::microseconds allowance() const { return next_; }

 private:
  const std::chrono::microseconds most_;
  std::chrono::microseconds next_;
  std::chrono::steady_clock::time_point idle_since_{};
};

}  // namespace tessera
