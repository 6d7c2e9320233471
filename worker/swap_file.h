// SwapFile: the disk tier of a CPU worker, where the memory plan swaps activations its host tier
// cannot hold (ZeRO-Infinity's and Harmony's next tier down), as a DeviceRuntime of Device::Disk().
//
// One file per process, made in a directory the user names (--swap-dir; on a local NVMe drive
// for speed) and unlinked at once, so that nothing is left behind however the process ends.
// Objects on the disk are regions of it: the allocator hands out file offsets (4 KiB aligned,
// first fit over the freed regions; the file grows as needed) as opaque pointers, never to be
// dereferenced, the way a GPU's allocator hands out device pointers. Copy moves bytes between
// host memory and a region with pwrite/pread, bypassing the page cache (O_DIRECT) where the file
// system allows it, so what is swapped out really leaves memory: the aligned body of a buffer
// goes straight from it, an unaligned head or tail through a small aligned bounce buffer. Where
// O_DIRECT is refused (tmpfs) the copies are buffered and what was written is dropped from the
// page cache after each write (posix_fadvise), best effort.
//
// Copies are synchronous (they return once the bytes are there, both ways); the executor runs the
// tasks that make them on its I/O thread, not in a compute slot (worker/in_process_executor.h),
// so a swap's wait overlaps compute. Capacity: the cap given, else what the file system has free
// when the file grows (ResourceExhausted naming the directory and the figures either way).
//
// Thread safety: every method may be called from any thread (the allocator under a mutex; copies
// are positional reads and writes of disjoint regions).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/device_runtime.h"
#include "core/status.h"

namespace tessera {

struct SwapFileOptions {
  std::string directory;       // where the file is made (must exist and be writable)
  int64_t capacity_bytes = 0;  // 0: what the file system has free
  // O_DIRECT where the file system takes it; false: always buffered (tests of the fallback).
  bool direct = true;
};

// NotFound (missing), InvalidArgument (not a directory) or Unavailable (read-only) naming the
// directory and the system error when it cannot hold a file, with what to pass instead.
Result<std::shared_ptr<DeviceRuntime>> OpenSwapFile(const SwapFileOptions& options);

// Whether the swap file behind `runtime` (from OpenSwapFile) bypasses the page cache.
bool SwapFileIsDirect(const DeviceRuntime& runtime);

}  // namespace tessera
