// RoleMeter: a run's live and peak bytes by object role (parameters, gradients, optimizer state,
// gathered parameters, gradient buckets, activations, ...): what a plan holds on a worker.
//
// The executor reports every change as one event: the outputs a task produced and the inputs
// it released. An output donated from an input it frees (an in-place update) takes that input's
// place rather than adding to it, as the plan intends; an output that could not reuse the
// buffer (the worker copied it) is still counted once, so these figures are the plan's memory,
// and the allocator's peak (RunStats::peak_bytes) is the process's. They are memory's: objects
// on the disk tier (swapped to a swap file) count as nothing; its allocator measures that tier.
// A task's kernel scratch (what its kernel allocates from KernelContext::allocator: the executor
// gives each kernel a CountingAllocator) is reported with its end, on top of what is live with
// its outputs: total_with_scratch_peak, the memory model's tier peaks. With several threads,
// tasks running at once overlap their scratch too; the figure counts one task's at a time.
//
// Model state is parameters + gradients + optimizer state (the ZeRO formulas); transient state is
// gathered parameters + gradient buckets, bounded by the plan's prefetch and bucket choices.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

#include "core/graph.h"
#include "core/thread_annotations.h"

namespace tessera {

struct RoleBytes {
  std::array<int64_t, kObjectRoles> peak{};  // per role, each at its own peak
  int64_t model_state_peak = 0;              // max of parameters + gradients + optimizer state
  int64_t transient_peak = 0;                // max of gathered parameters + gradient buckets
  int64_t total_peak = 0;                    // max of every role together
  // max of every role together plus the running task's kernel scratch (Change::scratch)
  int64_t total_with_scratch_peak = 0;
  int64_t operator[](ObjectRole role) const { return peak[static_cast<size_t>(role)]; }
};

class RoleMeter {
 public:
  // One event's bytes by role (fixed arrays: counting a task allocates nothing). `added` appear
  // alongside what is live, then `freed` disappear. `replaced` are freed inputs whose buffers
  // added outputs took over (donation): they never coexist with those outputs.
  struct Change {
    std::array<int64_t, kObjectRoles> added{}, freed{}, replaced{};
    // The task's kernel scratch at its most (freed before it ended): on top of what is live
    // with its outputs, for total_with_scratch_peak.
    int64_t scratch = 0;
    void Add(ObjectRole role, int64_t bytes) { added[static_cast<size_t>(role)] += bytes; }
    void Free(ObjectRole role, int64_t bytes) { freed[static_cast<size_t>(role)] += bytes; }
    void Replace(ObjectRole role, int64_t bytes) { replaced[static_cast<size_t>(role)] += bytes; }
  };
  void Add(ObjectRole role, int64_t bytes) {
    Change change;
    change.Add(role, bytes);
    Apply(change);
  }
  void Apply(const Change& change) EXCLUDES(mutex_) {
    MutexLock lock(&mutex_);
    for (size_t r = 0; r < kObjectRoles; ++r) live_[r] += change.added[r] - change.replaced[r];
    UpdatePeaks(change.scratch);
    for (size_t r = 0; r < kObjectRoles; ++r) live_[r] += change.replaced[r] - change.freed[r];
    UpdatePeaks(0);
  }
  RoleBytes bytes() const {
    MutexLock lock(&mutex_);
    return bytes_;
  }
  // What is live now, every role together (as of the last event).
  int64_t live_total() const {
    MutexLock lock(&mutex_);
    int64_t total = 0;
    for (int64_t bytes : live_) total += bytes;
    return total;
  }

  static bool IsModelState(ObjectRole role) {
    return role == ObjectRole::kParameter || role == ObjectRole::kGradient ||
           role == ObjectRole::kOptimizerState;
  }
  static bool IsTransient(ObjectRole role) {
    return role == ObjectRole::kGatheredParameter || role == ObjectRole::kGradientBucket;
  }

 private:
  void UpdatePeaks(int64_t scratch) REQUIRES(mutex_) {
    int64_t model_state = 0, transient = 0, total = 0;
    for (size_t r = 0; r < kObjectRoles; ++r) {
      const auto role = static_cast<ObjectRole>(r);
      total += live_[r];
      if (IsModelState(role)) model_state += live_[r];
      if (IsTransient(role)) transient += live_[r];
      bytes_.peak[r] = std::max(bytes_.peak[r], live_[r]);
    }
    bytes_.model_state_peak = std::max(bytes_.model_state_peak, model_state);
    bytes_.transient_peak = std::max(bytes_.transient_peak, transient);
    bytes_.total_peak = std::max(bytes_.total_peak, total);
    bytes_.total_with_scratch_peak = std::max(bytes_.total_with_scratch_peak, total + scratch);
  }

  mutable Mutex mutex_;
  std::array<int64_t, kObjectRoles> live_ GUARDED_BY(mutex_){};
  RoleBytes bytes_ GUARDED_BY(mutex_);
};

}  // namespace tessera
