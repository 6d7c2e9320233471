// A test op that tells which tasks started and in what order ("probe"): for the executor's and the
// graph runner's scheduling tests (executor_test, graph_runner_test).
//
// probe(x...) -> f32 scalar 0. Attributes: "tag" (int) is recorded when the kernel starts;
// "gate" (int, 1) makes the kernel wait until the test opens the gate; "fail" (int, 1) makes it
// fail with InvalidArgument "probe failed on purpose".
//
// The probe also notes the widest TBB arena a kernel ran in (widest_arena) and the threads
// kernels ran on (threads).
//
// Thread safety: the kernel may run on any thread; every method of Probe may be called from any
// thread. Invariant: `started()` lists tags in the order their kernels began.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <tbb/task_arena.h>

#include "ops/cpu/cpu_kernels.h"
#include "ops/op_registry.h"
#include "test_util.h"

namespace tessera::testing {

class Probe {
 public:
  std::vector<int64_t> started() const {
    std::lock_guard lock(mutex_);
    return started_;
  }
  // Whether the kernel tagged `tag` has started, waiting up to `seconds` for it.
  bool WaitStarted(int64_t tag, int seconds = 10) const {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, std::chrono::seconds(seconds), [&] {
      for (int64_t started : started_) {
        if (started == tag) return true;
      }
      return false;
    });
  }
  void OpenGate() {
    {
      std::lock_guard lock(mutex_);
      open_ = true;
    }
    changed_.notify_all();
  }

  // The largest concurrency of the TBB arena any kernel ran in (what its parallel loops could
  // use).
  int widest_arena() const {
    std::lock_guard lock(mutex_);
    return widest_arena_;
  }

  // The threads kernels ran on.
  std::set<std::thread::id> threads() const {
    std::lock_guard lock(mutex_);
    return threads_;
  }

  // Called by the kernel.
  void Started(int64_t tag, bool gated) {
    const int arena = tbb::this_task_arena::max_concurrency();
    std::unique_lock lock(mutex_);
    started_.push_back(tag);
    threads_.insert(std::this_thread::get_id());
    widest_arena_ = std::max(widest_arena_, arena);
    changed_.notify_all();
    if (gated) changed_.wait(lock, [this] { return open_; });
  }

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable changed_;
  std::vector<int64_t> started_;
  std::set<std::thread::id> threads_;
  bool open_ = false;
  int widest_arena_ = 0;
};

// Opens the probe's gate when it goes out of scope. Declared after the executor (or runner) that
// runs gated probes, so that a failed assertion does not leave a kernel waiting for the gate
// while the executor waits for it in its destructor.
class OpenGateAtExit {
 public:
  explicit OpenGateAtExit(Probe& probe) : probe_(probe) {}
  OpenGateAtExit(const OpenGateAtExit&) = delete;
  OpenGateAtExit& operator=(const OpenGateAtExit&) = delete;
  ~OpenGateAtExit() { probe_.OpenGate(); }

 private:
  Probe& probe_;
};

// The CPU registry plus "probe", reporting to `probe`. REQUIRES: probe outlives the registry's use.
inline Result<OpRegistry> RegistryWithProbe(Probe* probe) {
  TESSERA_ASSIGN_OR_RETURN(OpRegistry registry, MakeCpuOpRegistry());
  TESSERA_RETURN_IF_ERROR(registry.AddOp(OpDef{
      .name = "probe",
      .doc = "records its tag, may wait for a gate or fail (tests)",
      .input_names = {"x"},
      .output_names = {"out"},
      .variadic_inputs = true,
      .infer = [](const std::vector<TensorMeta>&, const Attrs&) -> Result<std::vector<TensorMeta>> {
        return std::vector<TensorMeta>{{Shape{}, DType::kF32, Device::Cpu()}};
      },
      .cost =
          [](const std::vector<TensorMeta>&, const Attrs&) {
            return OpCost{0, 4};
          },
  }));
  TESSERA_RETURN_IF_ERROR(
      registry.AddKernel("probe", DeviceKind::kCpu,
                         [probe](const KernelContext&, const std::vector<Tensor>&,
                                 const std::vector<Tensor>& out, const Attrs& attrs) -> Status {
                           probe->Started(attrs.GetInt("tag", 0), attrs.GetInt("gate", 0) == 1);
                           if (attrs.GetInt("fail", 0) == 1)
                             return InvalidArgument("probe failed on purpose");
                           *out[0].data<float>() = 0.0f;
                           return Status::Ok();
                         }));
  return registry;
}

}  // namespace tessera::testing
