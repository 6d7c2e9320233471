// Host memory allocation with accounting.
//
// Every tensor buffer comes from an Allocator. The base class counts live and peak bytes of
// the buffers it handed out (what the step's tensors occupy, not what a cache holds), so an
// executor can report a step's peak memory, and holds them under a cap when it has one
// (SetCap): an allocation that would take the live bytes past it fails with ResourceExhausted
// naming the cap and where it came from, before any memory is taken (the reservation is atomic,
// so threads allocating at once never pass it together). The memory planner plans a tier under
// the same cap (--host-memory-gib on CPU workers, a GPU allocator's cap on GPU workers): a
// capped allocator is what makes the plan's promise hold at run time instead of the kernel's
// out-of-memory killer ending the process mid-step.
// Loans (Lend): a buffer lent to a transfer (a push the peer copies out of this process's memory,
// core/transport/data_plane.h) stays live until the peer has read it, which takes the peer's
// progress thread a moment, longer on a loaded machine. The plan counts a pushed object freed
// after its last reader here, so an allocation the cap refuses while loans are out waits for
// them to come back (each return may free its buffer) and tries again; it fails once no loan is
// out, or after kLoanWait. Nothing waits while under the cap.
// Implementations supply DoAllocate/DoDeallocate:
//   - AlignedHostAllocator: aligned_alloc/free, nothing cached.
//   - CachingHostAllocator: keeps freed blocks by exact size and hands them out again. A step
//     graph allocates the same sizes every step, so after the first step nothing reaches the
//     system allocator; in particular large buffers stop paying mmap + page faults each step.
//     Under a cap, what it caches counts as well: a new block that would take the live and
//     cached bytes past the cap first gives the cache back, so the memory it holds from the
//     system stays under the cap too.
//
// Thread safety: Allocate/Deallocate and the statistics may be called from any thread.
// Ownership: an Allocator must outlive its buffers; Buffer holds a shared_ptr to guarantee it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/status.h"
#include "core/thread_annotations.h"

namespace tessera {

// Every buffer is aligned to this many bytes (one AVX-512 vector, one cache line).
inline constexpr int64_t kBufferAlignment = 64;

struct MemoryStats {
  int64_t live_bytes = 0;      // bytes in buffers currently allocated
  int64_t peak_bytes = 0;      // max live_bytes since construction or the last ResetPeak()
  int64_t reserved_bytes = 0;  // live bytes plus bytes held in a cache
};

class Allocator {
 public:
  virtual ~Allocator() = default;

  // Returns kBufferAlignment-aligned memory of `bytes` (>= 0), or ResourceExhausted (the cap, or
  // the system out of memory).
  Result<void*> Allocate(int64_t bytes);
  // REQUIRES: ptr came from Allocate(bytes) on this allocator and was not freed since.
  void Deallocate(void* ptr, int64_t bytes);

  // Holds the live bytes at or under `bytes` from now on (0: no cap); `source` says where the cap
  // comes from, for messages ("--host-memory-gib 0.25"). Buffers already live stay, even over a
  // new cap; the next allocation that would add to them fails.
  void SetCap(int64_t bytes, std::string source = "");
  int64_t cap() const { return cap_bytes_.load(std::memory_order_relaxed); }

  // For messages: what memory this is ("host", "cuda:0") and its limit (", cap 70.0 GiB (from
  // --gpu-memory-gib)").
  virtual std::string Name() const { return "host"; }
  virtual std::string Limit() const;
  // Where its memory is: the host, or a GPU (tensors of that device kind come from it).
  virtual DeviceKind kind() const { return DeviceKind::kCpu; }

  MemoryStats stats() const;
  // Starts a new peak-measurement window at the current live size.
  void ResetPeak();

  // `buffer` (one of `allocator`'s) lent out: the returned handle keeps it alive, and when the
  // borrower drops the handle the buffer is released first and the loan returned after, so an
  // allocation waiting on the cap sees the bytes gone. REQUIRES: allocator is not null.
  static std::shared_ptr<void> Lend(const std::shared_ptr<Allocator>& allocator,
                                    std::shared_ptr<void> buffer);
  int64_t loans_out() const { return loans_.load(std::memory_order_relaxed); }
  // Allocations that waited for loans so far (each counted once, whatever it then got).
  int64_t loan_waits() const { return loan_waits_.load(std::memory_order_relaxed); }
  // How long an allocation over the cap waits, in all, for loans to come back (a loan nobody
  // returns ends with the transfer's own deadline; this bounds the wait regardless).
  static constexpr std::chrono::seconds kLoanWait{30};

 protected:
  virtual void* DoAllocate(int64_t bytes) = 0;  // nullptr when exhausted
  virtual void DoDeallocate(void* ptr, int64_t bytes) = 0;
  // Why DoAllocate(bytes) just returned nullptr on this thread, `live` bytes being live: by
  // default the system's memory ran out.
  virtual Status AllocationFailure(int64_t bytes, int64_t live) const;
  virtual int64_t CachedBytes() const { return 0; }

 private:
  void ReturnLoan() EXCLUDES(loan_mutex_);
  // Waits until a loan comes back after the `seen`th return (or none is out), or `deadline`;
  // false when the deadline passed first.
  bool AwaitLoanReturn(uint64_t seen, std::chrono::steady_clock::time_point deadline)
      EXCLUDES(loan_mutex_);

  std::atomic<int64_t> live_bytes_{0};
  std::atomic<int64_t> peak_bytes_{0};
  std::atomic<int64_t> cap_bytes_{0};
  mutable Mutex cap_mutex_;
  std::string cap_source_ GUARDED_BY(cap_mutex_);
  std::atomic<int64_t> loans_{0};
  std::atomic<int64_t> loan_waits_{0};
  Mutex loan_mutex_;
  CondVar loan_returned_;
  // Written under loan_mutex_ (the waits' condition); read without it to note a wait's start.
  std::atomic<uint64_t> loans_returned_{0};
};

class AlignedHostAllocator final : public Allocator {
 protected:
  void* DoAllocate(int64_t bytes) override;
  void DoDeallocate(void* ptr, int64_t bytes) override;
};

// Another allocator's memory, counted apart: what one kernel takes as scratch (the executor gives
// each kernel one: worker/task_runner.cc). Its stats() are the buffers it handed out; the wrapped
// allocator counts (and caps) them as well.
class CountingAllocator final : public Allocator {
 public:
  // REQUIRES: base is not null.
  explicit CountingAllocator(std::shared_ptr<Allocator> base) : base_(std::move(base)) {}
  std::string Name() const override { return base_->Name() + " (a kernel's scratch)"; }
  std::string Limit() const override;
  DeviceKind kind() const override { return base_->kind(); }

 protected:
  void* DoAllocate(int64_t bytes) override;
  void DoDeallocate(void* ptr, int64_t bytes) override { base_->Deallocate(ptr, bytes); }
  // The base's refusal (its cap, or the system), as a kernel's scratch.
  Status AllocationFailure(int64_t bytes, int64_t live) const override;

 private:
  std::shared_ptr<Allocator> base_;
};

// One AlignedHostAllocator for the process: tensors a driver builds to feed a step.
std::shared_ptr<Allocator> SharedHostAllocator();

// Host memory a new allocation can still get without swapping: Linux's MemAvailable (free
// memory plus what the page cache would give back), else the physical pages; 0 when unknown.
int64_t AvailableHostMemoryBytes();

// The machine's physical memory (sysconf's pages times the page size); 0 when unknown. What no
// single process can ever hold: inputs that would need more are refused, whatever is free now.
int64_t PhysicalHostMemoryBytes();

class CachingHostAllocator final : public Allocator {
 public:
  ~CachingHostAllocator() override;
  // Returns every cached block to the system.
  void ReleaseCache() EXCLUDES(mutex_);

 protected:
  void* DoAllocate(int64_t bytes) override;
  void DoDeallocate(void* ptr, int64_t bytes) override;
  int64_t CachedBytes() const override;

 private:
  mutable Mutex mutex_;
  std::map<int64_t, std::vector<void*>> free_blocks_ GUARDED_BY(mutex_);  // rounded size -> blocks
  int64_t cached_bytes_ GUARDED_BY(mutex_) = 0;
};

// A contiguous block of host memory owned by one Allocator, shared by the tensors that view it.
class Buffer {
  struct Passkey {
    explicit Passkey() = default;
  };

 public:
  static Result<std::shared_ptr<Buffer>> Allocate(int64_t bytes,
                                                  std::shared_ptr<Allocator> allocator);
  // Only Allocate can call it (the key is private); public so that make_shared puts the buffer
  // and its reference count in one allocation.
  Buffer(Passkey /*key*/, void* data, int64_t size, std::shared_ptr<Allocator> allocator)
      : data_(data), size_(size), allocator_(std::move(allocator)) {}
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  int64_t size() const { return size_; }
  // A handle lending `buffer` out (Allocator::Lend on its allocator); null for null.
  static std::shared_ptr<void> Lend(std::shared_ptr<Buffer> buffer);

 private:
  void* data_;
  int64_t size_;
  std::shared_ptr<Allocator> allocator_;
};

}  // namespace tessera
