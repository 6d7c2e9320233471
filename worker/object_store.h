// ObjectStore: one worker's objects, in host memory up to a capacity and spilled to disk
// beyond it.
//
// Tiers: the host tier holds objects as Tensors and is capped at `host_capacity_bytes`; the disk
// tier holds spilled objects as one file each in `spill_dir` (written atomically, checked on
// restore). The device tier holds a GPU worker's objects that live on its GPU (parameters,
// optimizer state, activations kept between instances) where its plan put them: they count
// toward the GPU allocator's cap, not the host tier's, and are never spilled (moving them off
// the GPU is a task of the plan: the `copy` transfer op). Get hands them out as they are;
// whoever needs their bytes on the host copies them (worker/task_runner.h: HostCopyOf).
//
// Policy: when an object must enter the host tier (Put, or a restore for Get) and does not fit,
// the least recently used unpinned objects are spilled until it does. An object is pinned while
// a task or a transfer uses it (PinnedObject, RAII); pinned objects are never spilled. If the
// object cannot fit even after spilling every unpinned object, Put writes it straight to disk
// and Get fails with ResourceExhausted naming the sizes.
//
// Spill files are scratch: a store deletes those of an earlier one in its directory when it
// starts, so they are written in place, not fsynced or renamed (a crash mid-write leaves a file
// nobody reads); a checksum in the header catches a damaged or truncated one on restore.
//
// Objects are immutable: Put of an existing id is AlreadyExists. Reference counts live in the
// scheduler; the store deletes an object when told to (Delete).
//
// Thread safety: every method may be called from any thread (executor threads, the data plane,
// the control thread). Disk I/O happens outside the store's lock: while one caller writes a spill
// or reads one back, the others go on (a worker's heartbeat reads stats() on its I/O thread, so a
// spill of gigabytes must not hold it). An object being spilled is still in memory: Get hands it
// out (and the spill, once written, is dropped, the object staying in memory); Delete forgets it
// at once. An object being restored makes other Gets of it wait for the read; callers needing
// room wait for spills in flight that will make it.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/allocator.h"
#include "core/ids.h"
#include "core/status.h"
#include "core/tensor.h"
#include "core/thread_annotations.h"

namespace tessera {

enum class StorageTier : uint8_t { kHost, kDisk, kDevice };

struct ObjectStoreOptions {
  int64_t host_capacity_bytes = int64_t{1} << 40;
  std::string spill_dir;  // required for spilling; empty disables it
};

struct ObjectStoreStats {
  int64_t host_bytes = 0;
  int64_t host_capacity_bytes = 0;
  int64_t spilled_bytes = 0;
  int64_t objects = 0;
  int64_t spills = 0;               // objects written to disk so far
  int64_t spilled_total_bytes = 0;  // their bytes
  int64_t restores = 0;             // objects read back so far
  int64_t device_bytes = 0;         // objects in the device tier
  int64_t spilling_bytes = 0;       // being written to disk now (still in host_bytes)
};

class ObjectStore;

// Keeps an object in host memory while held. Movable, not copyable.
class PinnedObject {
 public:
  PinnedObject() = default;
  PinnedObject(PinnedObject&& other) noexcept;
  PinnedObject& operator=(PinnedObject&& other) noexcept;
  ~PinnedObject();
  const Tensor& tensor() const { return tensor_; }
  ObjectId id() const { return id_; }

 private:
  friend class ObjectStore;
  PinnedObject(ObjectStore* store, ObjectId id, Tensor tensor)
      : store_(store), id_(id), tensor_(std::move(tensor)) {}
  void Release();
  ObjectStore* store_ = nullptr;
  ObjectId id_;
  Tensor tensor_;
};

class ObjectStore {
 public:
  ObjectStore(ObjectStoreOptions options, std::shared_ptr<Allocator> allocator);
  ~ObjectStore();

  // Adds a sealed object: a device tensor to the device tier, a host one to the host tier.
  // AlreadyExists for a duplicate id; errors from spilling otherwise.
  Status Put(ObjectId id, Tensor tensor);
  // The object in host memory (restored from disk if spilled), or in the device tier as it is;
  // pinned while the handle lives.
  // NotFound for an unknown id; DataLoss for a damaged spill file; ResourceExhausted when it
  // cannot be brought into the host tier.
  Result<PinnedObject> Get(ObjectId id);
  // Removes the object from whichever tier holds it. NotFound for an unknown id.
  Status Delete(ObjectId id);
  bool Contains(ObjectId id) const;
  Result<StorageTier> TierOf(ObjectId id) const;
  ObjectStoreStats stats() const;

 private:
  friend class PinnedObject;
  enum class State : uint8_t {
    kHost,       // in memory, in lru_
    kDevice,     // in the device tier
    kSpilling,   // in memory, not in lru_: its spill file is being written
    kDisk,       // in its spill file only
    kRestoring,  // being read back (its bytes already counted in host_bytes_)
  };
  struct Entry {
    TensorMeta meta;
    State state = State::kHost;
    uint64_t serial = 0;     // tells an entry from a later one of the same id
    Tensor tensor;           // defined in kHost, kDevice and kSpilling
    std::string spill_path;  // set in kDisk and kRestoring
    int pins = 0;
    std::list<ObjectId>::iterator lru;  // position in lru_ in kHost
  };

  void Unpin(ObjectId id) EXCLUDES(mutex_);
  // Until the host tier holds what it counts, the caller's `bytes` already among them (an object
  // being put or restored, named in the errors): spills unpinned host objects, least recently
  // used first, or waits for spills in flight that will make the room. Drops the lock while it
  // writes or waits (entries may come and go meanwhile).
  Status MakeRoom(int64_t bytes) REQUIRES(mutex_);
  // Writes the objects (unpinned, in kHost) to their spill files outside the lock, then drops
  // from memory those still unpinned and not deleted. The first write error, if any (those
  // objects stay in memory).
  Status Spill(const std::vector<ObjectId>& ids) REQUIRES(mutex_);
  // Unique per entry (an id deleted while spilled and put again gets a file of its own).
  std::string SpillPath(ObjectId id, uint64_t serial) const;
  Result<Tensor> ReadSpillFile(const std::string& path, const TensorMeta& meta) const;
  // The entry of `id` if it is still the one with `serial`; nullptr otherwise.
  Entry* FindCurrent(ObjectId id, uint64_t serial) REQUIRES(mutex_);
  void Touch(ObjectId id, Entry& entry) REQUIRES(mutex_);  // REQUIRES: entry in kHost

  const ObjectStoreOptions options_;
  std::shared_ptr<Allocator> allocator_;
  mutable Mutex mutex_;
  CondVar io_done_;  // a spill or a restore finished
  std::unordered_map<ObjectId, Entry> entries_ GUARDED_BY(mutex_);
  // Host-tier objects, most recently used at the front.
  std::list<ObjectId> lru_ GUARDED_BY(mutex_);
  // kHost, kSpilling and kRestoring entries' bytes (those being restored reserved up front).
  int64_t host_bytes_ GUARDED_BY(mutex_) = 0;
  int64_t spilling_bytes_ GUARDED_BY(mutex_) = 0;  // kSpilling entries' bytes
  uint64_t next_serial_ GUARDED_BY(mutex_) = 1;
  int64_t device_bytes_ GUARDED_BY(mutex_) = 0;
  int64_t spilled_bytes_ GUARDED_BY(mutex_) = 0;
  int64_t spills_ GUARDED_BY(mutex_) = 0;
  int64_t spilled_total_bytes_ GUARDED_BY(mutex_) = 0;
  int64_t restores_ GUARDED_BY(mutex_) = 0;
};

}  // namespace tessera
