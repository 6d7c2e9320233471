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
// Objects are immutable: Put of an existing id is AlreadyExists. Reference counts live in the
// scheduler; the store deletes an object when told to (Delete).
//
// Thread safety: every method may be called from any thread (executor threads, the data plane,
// the control thread). Disk I/O happens under the store's lock (it blocks other callers while a
// spill is written or read back).
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>

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
  struct Entry {
    TensorMeta meta;
    Tensor tensor;           // defined while in the host or the device tier
    std::string spill_path;  // non-empty while on disk
    int pins = 0;
    std::list<ObjectId>::iterator lru;  // position in lru_ while in the host tier
  };

  void Unpin(ObjectId id) EXCLUDES(mutex_);
  // Spills unpinned host objects, least recently used first, until `bytes` more fit.
  Status MakeRoom(int64_t bytes) REQUIRES(mutex_);
  Status SpillToDisk(ObjectId id, Entry& entry) REQUIRES(mutex_);
  Result<Tensor> ReadSpillFile(const Entry& entry) const;
  void Touch(ObjectId id, Entry& entry) REQUIRES(mutex_);  // REQUIRES: entry in the host tier

  const ObjectStoreOptions options_;
  std::shared_ptr<Allocator> allocator_;
  mutable Mutex mutex_;
  std::unordered_map<ObjectId, Entry> entries_ GUARDED_BY(mutex_);
  // Host-tier objects, most recently used at the front.
  std::list<ObjectId> lru_ GUARDED_BY(mutex_);
  int64_t host_bytes_ GUARDED_BY(mutex_) = 0;
  int64_t device_bytes_ GUARDED_BY(mutex_) = 0;
  int64_t spilled_bytes_ GUARDED_BY(mutex_) = 0;
  int64_t spills_ GUARDED_BY(mutex_) = 0;
  int64_t spilled_total_bytes_ GUARDED_BY(mutex_) = 0;
  int64_t restores_ GUARDED_BY(mutex_) = 0;
};

}  // namespace tessera
