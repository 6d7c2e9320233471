#include "core/allocator.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <optional>

namespace tessera {

namespace {
int64_t RoundUpToAlignment(int64_t bytes) {
  int64_t rounded = (bytes + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
  return rounded == 0 ? kBufferAlignment : rounded;
}

// Host memory for a buffer of `rounded` bytes. Large buffers (a model's parameters, gradients
// and optimizer state) are aligned to 2 MiB and marked for transparent huge pages: their first
// touch then takes one page fault per 2 MiB instead of per 4 KiB, and streaming over them (an
// offloaded AdamW over tens of GB) misses the TLB less. Where THP is off, the advice is ignored.
// Buffers of 64 KiB and more start on a page, so a swap to the disk (worker/swap_file.h) can
// write them straight from where they are (O_DIRECT needs aligned memory).
void* AllocateHostBytes(int64_t rounded) {
  constexpr int64_t kHugePage = int64_t{2} << 20, kPage = 4096;
  if (rounded < 16 * kPage) {
    return std::aligned_alloc(kBufferAlignment, static_cast<size_t>(rounded));
  }
  if (rounded < 2 * kHugePage) {
    return std::aligned_alloc(kPage, static_cast<size_t>((rounded + kPage - 1) / kPage * kPage));
  }
  const int64_t size = (rounded + kHugePage - 1) / kHugePage * kHugePage;
  void* block = std::aligned_alloc(static_cast<size_t>(kHugePage), static_cast<size_t>(size));
  if (block != nullptr) madvise(block, static_cast<size_t>(size), MADV_HUGEPAGE);
  return block;
}
}  // namespace

Result<void*> Allocator::Allocate(int64_t bytes) {
  TESSERA_CHECK(bytes >= 0, "negative allocation size {}", bytes);
  // Reserve the bytes first, so that threads allocating at once never pass the cap together.
  const int64_t cap = cap_bytes_.load(std::memory_order_relaxed);
  int64_t live = live_bytes_.load(std::memory_order_relaxed);
  std::optional<std::chrono::steady_clock::time_point> deadline;
  for (;;) {
    if (cap > 0 && live + bytes > cap) {
      // Loans out (pushes the peers have not read yet): their buffers may free room.
      if (loans_.load(std::memory_order_acquire) > 0) {
        if (!deadline) {
          deadline = std::chrono::steady_clock::now() + kLoanWait;
          loan_waits_.fetch_add(1, std::memory_order_relaxed);
        }
        // A return counted before `seen` has freed its bytes already (the buffer goes first):
        // the live bytes read after it show them; one after it ends the wait.
        const uint64_t seen = loans_returned_.load(std::memory_order_acquire);
        live = live_bytes_.load(std::memory_order_relaxed);
        if (live + bytes <= cap || AwaitLoanReturn(seen, *deadline)) {
          live = live_bytes_.load(std::memory_order_relaxed);
          continue;  // checked against the cap again
        }
      }
      return ResourceExhausted(
          "{} allocation of {} bytes would pass its cap ({} bytes live{}): the step needs more "
          "of this memory than the cap leaves; plan under the cap (the memory planner's "
          "--explain-memory says what it predicted) or raise the cap",
          Name(), bytes, live, Limit());
    }
    // On failure `live` is reloaded and checked again.
    if (live_bytes_.compare_exchange_weak(live, live + bytes, std::memory_order_relaxed)) break;
  }
  void* ptr = DoAllocate(bytes);
  if (ptr == nullptr) {
    live = live_bytes_.fetch_sub(bytes, std::memory_order_relaxed) - bytes;
    return AllocationFailure(bytes, live);
  }
  live += bytes;
  int64_t peak = peak_bytes_.load(std::memory_order_relaxed);
  while (live > peak && !peak_bytes_.compare_exchange_weak(peak, live)) {
  }
  return ptr;
}

void Allocator::Deallocate(void* ptr, int64_t bytes) {
  live_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
  DoDeallocate(ptr, bytes);
}

std::shared_ptr<void> Allocator::Lend(const std::shared_ptr<Allocator>& allocator,
                                      std::shared_ptr<void> buffer) {
  TESSERA_CHECK(allocator != nullptr, "a loan needs the allocator it counts on");
  allocator->loans_.fetch_add(1, std::memory_order_acq_rel);
  void* data = buffer.get();
  // The deleter drops the buffer (freeing it when nobody else holds it), then returns the loan.
  return std::shared_ptr<void>(data, [buffer = std::move(buffer), allocator](void*) mutable {
    buffer.reset();
    allocator->ReturnLoan();
  });
}

std::shared_ptr<void> Buffer::Lend(std::shared_ptr<Buffer> buffer) {
  if (buffer == nullptr || buffer->allocator_ == nullptr) return buffer;
  const std::shared_ptr<Allocator> allocator = buffer->allocator_;
  return Allocator::Lend(allocator, std::move(buffer));
}

void Allocator::ReturnLoan() {
  loans_.fetch_sub(1, std::memory_order_acq_rel);
  MutexLock lock(&loan_mutex_);
  loans_returned_.fetch_add(1, std::memory_order_acq_rel);
  loan_returned_.NotifyAll();
}

bool Allocator::AwaitLoanReturn(uint64_t seen, std::chrono::steady_clock::time_point deadline) {
  MutexLock lock(&loan_mutex_);
  const auto returned_since = [&] {
    return loans_returned_.load(std::memory_order_acquire) != seen;
  };
  while (!returned_since() && loans_.load(std::memory_order_acquire) > 0) {
    if (!loan_returned_.WaitUntil(&loan_mutex_, deadline)) return returned_since();
  }
  return true;
}

void Allocator::SetCap(int64_t bytes, std::string source) {
  TESSERA_CHECK(bytes >= 0, "negative allocator cap {}", bytes);
  MutexLock lock(&cap_mutex_);
  cap_source_ = std::move(source);
  cap_bytes_.store(bytes, std::memory_order_relaxed);
}

std::string Allocator::Limit() const {
  const int64_t cap = this->cap();
  if (cap <= 0) return "";
  MutexLock lock(&cap_mutex_);
  return fmt::format(", cap {} bytes ({:.2f} MiB{}{})", cap, cap / double(1 << 20),
                     cap_source_.empty() ? "" : ", from ", cap_source_);
}

Status Allocator::AllocationFailure(int64_t bytes, int64_t live) const {
  return ResourceExhausted("{} allocation of {} bytes failed ({} bytes live{})", Name(), bytes,
                           live, Limit());
}

namespace {
// The base allocator's refusal of the last CountingAllocator::DoAllocate on this thread (a
// kernel's allocations run on its own thread, one at a time).
thread_local Status last_base_failure;
}  // namespace

void* CountingAllocator::DoAllocate(int64_t bytes) {
  Result<void*> ptr = base_->Allocate(bytes);
  if (ptr.ok()) return *ptr;
  last_base_failure = ptr.status();
  return nullptr;
}

Status CountingAllocator::AllocationFailure(int64_t bytes, int64_t live) const {
  if (last_base_failure.ok()) return Allocator::AllocationFailure(bytes, live);
  return last_base_failure.WithContext(
      fmt::format("a kernel's scratch ({} bytes of it live)", live));
}

std::string CountingAllocator::Limit() const {
  return fmt::format("; {} bytes live in all{}", base_->stats().live_bytes, base_->Limit());
}

MemoryStats Allocator::stats() const {
  MemoryStats stats;
  stats.live_bytes = live_bytes_.load();
  stats.peak_bytes = peak_bytes_.load();
  stats.reserved_bytes = stats.live_bytes + CachedBytes();
  return stats;
}

void Allocator::ResetPeak() { peak_bytes_.store(live_bytes_.load()); }

void* AlignedHostAllocator::DoAllocate(int64_t bytes) {
  return AllocateHostBytes(RoundUpToAlignment(bytes));
}

void AlignedHostAllocator::DoDeallocate(void* ptr, int64_t /*bytes*/) { std::free(ptr); }

CachingHostAllocator::~CachingHostAllocator() { ReleaseCache(); }

void CachingHostAllocator::ReleaseCache() {
  MutexLock lock(&mutex_);
  for (auto& [size, blocks] : free_blocks_) {
    for (void* block : blocks) std::free(block);
  }
  free_blocks_.clear();
  cached_bytes_ = 0;
}

void* CachingHostAllocator::DoAllocate(int64_t bytes) {
  const int64_t rounded = RoundUpToAlignment(bytes);
  {
    MutexLock lock(&mutex_);
    auto it = free_blocks_.find(rounded);
    if (it != free_blocks_.end() && !it->second.empty()) {
      void* block = it->second.back();
      it->second.pop_back();
      cached_bytes_ -= rounded;
      return block;
    }
  }
  // Under a cap, what the cache holds counts too (the live bytes already hold this one's
  // reservation): make room by giving the cache back rather than hold more than the cap.
  const int64_t cap = this->cap();
  if (cap > 0 && stats().reserved_bytes > cap) ReleaseCache();
  void* block = AllocateHostBytes(rounded);
  if (block == nullptr) {
    // Out of memory with blocks of other sizes parked in the cache: give them back and retry.
    ReleaseCache();
    block = AllocateHostBytes(rounded);
  }
  return block;
}

void CachingHostAllocator::DoDeallocate(void* ptr, int64_t bytes) {
  const int64_t rounded = RoundUpToAlignment(bytes);
  MutexLock lock(&mutex_);
  free_blocks_[rounded].push_back(ptr);
  cached_bytes_ += rounded;
}

int64_t CachingHostAllocator::CachedBytes() const {
  MutexLock lock(&mutex_);
  return cached_bytes_;
}

int64_t AvailableHostMemoryBytes() {
  if (std::FILE* meminfo = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    long long kib = -1;
    while (std::fgets(line, sizeof(line), meminfo) != nullptr) {
      if (std::sscanf(line, "MemAvailable: %lld kB", &kib) == 1) break;
    }
    std::fclose(meminfo);
    if (kib >= 0) return static_cast<int64_t>(kib) * 1024;
  }
  const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}

int64_t PhysicalHostMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}

std::shared_ptr<Allocator> SharedHostAllocator() {
  static const auto allocator = std::make_shared<AlignedHostAllocator>();
  return allocator;
}

Result<std::shared_ptr<Buffer>> Buffer::Allocate(int64_t bytes,
                                                 std::shared_ptr<Allocator> allocator) {
  TESSERA_CHECK(allocator != nullptr);
  TESSERA_ASSIGN_OR_RETURN(void* data, allocator->Allocate(bytes));
  return std::make_shared<Buffer>(Passkey{}, data, bytes, std::move(allocator));
}

Buffer::~Buffer() { allocator_->Deallocate(data_, size_); }

}  // namespace tessera
