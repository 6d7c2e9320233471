#include "worker/swap_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "core/thread_annotations.h"

namespace tessera {

namespace {

// File offsets, sizes and memory addresses of direct transfers are multiples of this (the
// largest logical block size of common drives; O_DIRECT needs the device's).
constexpr int64_t kBlock = 4096;
// The opaque pointer of offset o is kBase + o: never null, never a host address to read.
constexpr uintptr_t kBase = uintptr_t{1} << 12;
// Unaligned transfers go through an aligned bounce buffer this large at a time.
constexpr int64_t kBounceBytes = int64_t{1} << 20;

int64_t RoundUp(int64_t bytes) {
  return (std::max<int64_t>(bytes, 1) + kBlock - 1) / kBlock * kBlock;
}

std::string Errno(int error) { return std::strerror(error); }

double GiB(int64_t bytes) { return static_cast<double>(bytes) / double(int64_t{1} << 30); }

// What the file system holding `directory` has free for this user; -1 when unknown.
int64_t FreeBytes(const std::string& directory) {
  struct statvfs fs {};
  if (statvfs(directory.c_str(), &fs) != 0) return -1;
  return static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize);
}

// Regions of the file as allocations: first fit over the free regions (merged with their
// neighbours when freed), else the end of the file.
class SwapFileAllocator final : public Allocator {
 public:
  SwapFileAllocator(std::string directory, int64_t capacity)
      : directory_(std::move(directory)), capacity_(capacity) {}
  std::string Name() const override { return fmt::format("disk (swap file in {})", directory_); }
  std::string Limit() const override {
    if (capacity_ > 0) return fmt::format(", cap {:.2f} GiB", GiB(capacity_));
    const int64_t free = FreeBytes(directory_);
    return free < 0 ? "" : fmt::format(", {:.2f} GiB free on its file system", GiB(free));
  }
  DeviceKind kind() const override { return DeviceKind::kDisk; }
  int64_t capacity() const { return capacity_; }

  static int64_t OffsetOf(const void* pointer) {
    return static_cast<int64_t>(reinterpret_cast<uintptr_t>(pointer) - kBase);
  }

 protected:
  void* DoAllocate(int64_t bytes) override {
    const int64_t size = RoundUp(bytes);
    MutexLock lock(&mutex_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < size) continue;
      const int64_t offset = it->first, left = it->second - size;
      free_.erase(it);
      if (left > 0) free_[offset + size] = left;
      return PointerOf(offset);
    }
    // The end of the file: within the cap, or within what the file system has free (when it
    // cannot say, the write will).
    const int64_t free = capacity_ > 0 ? capacity_ - end_ : FreeBytes(directory_);
    if (free >= 0 && size > free) return nullptr;
    const int64_t offset = end_;
    end_ += size;
    return PointerOf(offset);
  }
  void DoDeallocate(void* pointer, int64_t bytes) override {
    int64_t offset = OffsetOf(pointer), size = RoundUp(bytes);
    MutexLock lock(&mutex_);
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && next->first == offset + size) {
      size += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto previous = std::prev(next);
      if (previous->first + previous->second == offset) {
        offset = previous->first;
        size += previous->second;
        free_.erase(previous);
      }
    }
    if (offset + size == end_) {
      end_ = offset;  // the file's tail is free: later allocations start there
    } else {
      free_[offset] = size;
    }
  }

 private:
  static void* PointerOf(int64_t offset) {
    // An opaque handle, never dereferenced (as a GPU's device pointers are to the host).
    return reinterpret_cast<void*>(  // NOLINT(performance-no-int-to-ptr)
        kBase + static_cast<uintptr_t>(offset));
  }

  const std::string directory_;
  const int64_t capacity_;
  Mutex mutex_;
  std::map<int64_t, int64_t> free_ GUARDED_BY(mutex_);  // offset -> size, not adjacent
  int64_t end_ GUARDED_BY(mutex_) = 0;                  // the first byte past every allocation
};

// An aligned host buffer for the parts of a transfer O_DIRECT cannot take from the caller's.
struct Bounce {
  explicit Bounce(int64_t bytes)
      : data(static_cast<char*>(std::aligned_alloc(kBlock, static_cast<size_t>(bytes)))) {}
  ~Bounce() { std::free(data); }
  Bounce(const Bounce&) = delete;
  Bounce& operator=(const Bounce&) = delete;
  char* data;
};

class SwapFile final : public DeviceRuntime {
 public:
  SwapFile(int fd, bool direct, const SwapFileOptions& options)
      : fd_(fd),
        direct_(direct),
        directory_(options.directory),
        allocator_(std::make_shared<SwapFileAllocator>(options.directory, options.capacity_bytes)) {
  }
  ~SwapFile() override { ::close(fd_); }
  SwapFile(const SwapFile&) = delete;
  SwapFile& operator=(const SwapFile&) = delete;

  Device device() const override { return Device::Disk(); }
  std::string Describe() const override {
    return fmt::format("swap file in {} ({}{})", directory_,
                       direct_ ? "direct I/O" : "buffered: the file system refused O_DIRECT",
                       allocator_->Limit());
  }
  std::shared_ptr<Allocator> allocator() const override { return allocator_; }
  DeviceMemoryStats memory() const override {
    const MemoryStats stats = allocator_->stats();
    return {allocator_->capacity(), stats.live_bytes, stats.peak_bytes, stats.reserved_bytes};
  }
  Status Copy(void* dst, Device dst_device, const void* src, Device src_device,
              int64_t bytes) override {
    if (bytes <= 0) return Status::Ok();
    if (dst_device.kind == DeviceKind::kDisk && src_device.is_cpu()) {
      // Only read (one path serves both directions, hence the cast).
      return Move(/*write=*/true, const_cast<char*>(static_cast<const char*>(src)),
                  SwapFileAllocator::OffsetOf(dst), bytes);
    }
    if (src_device.kind == DeviceKind::kDisk && dst_device.is_cpu()) {
      return Move(/*write=*/false, static_cast<char*>(dst), SwapFileAllocator::OffsetOf(src),
                  bytes);
    }
    return InvalidArgument("the swap file copies between the host and the disk, not {} -> {}",
                           src_device.ToString(), dst_device.ToString());
  }
  Status Synchronize() override { return Status::Ok(); }  // every copy has finished on return
  void* native() override { return this; }

  bool direct() const { return direct_; }

 private:
  // Host memory to the region at `offset` (write) or back: the whole-block body straight from or
  // into the caller's memory when it is aligned (O_DIRECT), the rest through a bounce buffer,
  // padded to whole blocks (the region was allocated rounded up, so the padding is this object's).
  Status Move(bool write, char* host, int64_t offset, int64_t bytes) {
    int64_t done = 0;
    if (Aligned(host)) {
      done = bytes / kBlock * kBlock;
      TESSERA_RETURN_IF_ERROR(Transfer(write, host, done, offset));
    }
    if (done < bytes) {
      Bounce bounce(RoundUp(std::min(bytes - done, kBounceBytes)));
      if (bounce.data == nullptr) return ResourceExhausted("no memory for a swap bounce buffer");
      while (done < bytes) {
        const int64_t chunk = std::min(bytes - done, kBounceBytes);
        if (write) {
          std::memcpy(bounce.data, host + done, static_cast<size_t>(chunk));
          std::memset(bounce.data + chunk, 0, static_cast<size_t>(RoundUp(chunk) - chunk));
        }
        TESSERA_RETURN_IF_ERROR(Transfer(write, bounce.data, RoundUp(chunk), offset + done));
        if (!write) std::memcpy(host + done, bounce.data, static_cast<size_t>(chunk));
        done += chunk;
      }
    }
    if (write && !direct_) {  // best effort: the written pages need not stay in memory
      (void)::posix_fadvise(fd_, offset, bytes, POSIX_FADV_DONTNEED);
    }
    return Status::Ok();
  }

  static bool Aligned(const void* pointer) {
    return reinterpret_cast<uintptr_t>(pointer) % static_cast<uintptr_t>(kBlock) == 0;
  }

  // pwrite/pread of the whole range (retrying short transfers and interrupts).
  Status Transfer(bool write, char* data, int64_t bytes, int64_t offset) {
    while (bytes > 0) {
      const ssize_t n = write ? ::pwrite(fd_, data, static_cast<size_t>(bytes), offset)
                              : ::pread(fd_, data, static_cast<size_t>(bytes), offset);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int error = n < 0 ? errno : EIO;
        return DataLoss("{} {} bytes at offset {} of the swap file in {}: {}{}",
                        write ? "writing" : "reading", bytes, offset, directory_, Errno(error),
                        error == ENOSPC ? " (free space there, or pass another --swap-dir)" : "");
      }
      data += n;
      bytes -= n;
      offset += n;
    }
    return Status::Ok();
  }

  const int fd_;
  const bool direct_;
  const std::string directory_;
  std::shared_ptr<SwapFileAllocator> allocator_;
};

// An unlinked file in `directory`: O_TMPFILE where the file system has it, else a named one
// removed at once.
Result<int> MakeUnlinkedFile(const std::string& directory, int flags) {
  int fd = ::open(directory.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC | flags, 0600);
  if (fd >= 0) return fd;
  std::string path = directory + "/tessera-swap-XXXXXX";
  fd = ::mkostemp(path.data(), O_CLOEXEC);
  if (fd < 0) {
    return Unavailable(
        "cannot make a swap file in {}: {} (pass --swap-dir a writable directory on a local "
        "drive)",
        directory, Errno(errno));
  }
  ::unlink(path.c_str());
  if (flags != 0 && ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | flags) != 0) {
    const int error = errno;
    ::close(fd);
    return Unavailable("swap file in {}: {}", directory, Errno(error));
  }
  return fd;
}

// Whether direct I/O works on `fd` (some file systems accept the flag and fail the first write).
bool DirectWriteWorks(int fd) {
  Bounce probe(kBlock);
  if (probe.data == nullptr) return false;
  std::memset(probe.data, 0, kBlock);
  return ::pwrite(fd, probe.data, kBlock, 0) == kBlock;
}

}  // namespace

Result<std::shared_ptr<DeviceRuntime>> OpenSwapFile(const SwapFileOptions& options) {
  if (options.directory.empty()) {
    return InvalidArgument("no directory for the swap file (pass --swap-dir DIR)");
  }
  if (options.capacity_bytes < 0) {
    return InvalidArgument("swap file capacity {} bytes: must be >= 0 (0: the free space)",
                           options.capacity_bytes);
  }
  struct stat info {};
  if (::stat(options.directory.c_str(), &info) != 0) {
    return NotFound("swap directory {}: {} (create it, or pass --swap-dir an existing directory)",
                    options.directory, Errno(errno));
  }
  if (!S_ISDIR(info.st_mode)) {
    return InvalidArgument("swap directory {} is not a directory (pass --swap-dir a directory)",
                           options.directory);
  }
  if (options.direct) {
    Result<int> fd = MakeUnlinkedFile(options.directory, O_DIRECT);
    if (fd.ok() && DirectWriteWorks(*fd)) {
      return std::shared_ptr<DeviceRuntime>(std::make_shared<SwapFile>(*fd, true, options));
    }
    if (fd.ok()) ::close(*fd);
  }
  TESSERA_ASSIGN_OR_RETURN(int fd, MakeUnlinkedFile(options.directory, 0));
  return std::shared_ptr<DeviceRuntime>(std::make_shared<SwapFile>(fd, false, options));
}

bool SwapFileIsDirect(const DeviceRuntime& runtime) {
  const auto* file = dynamic_cast<const SwapFile*>(&runtime);
  return file != nullptr && file->direct();
}

}  // namespace tessera
