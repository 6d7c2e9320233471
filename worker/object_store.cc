#include "worker/object_store.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/atomic_file.h"
#include "core/checksum.h"

namespace tessera {

namespace {

// Spill file: [u64 magic][u64 payload bytes][u64 checksum (Fnv1aWords)][payload].
constexpr uint64_t kSpillMagic = 0x314c4c4950535354;  // "TSSPILL1"
constexpr size_t kSpillHeaderBytes = 24;

}  // namespace

PinnedObject::PinnedObject(PinnedObject&& other) noexcept
    : store_(std::exchange(other.store_, nullptr)),
      id_(other.id_),
      tensor_(std::move(other.tensor_)) {}

PinnedObject& PinnedObject::operator=(PinnedObject&& other) noexcept {
  if (this != &other) {
    Release();
    store_ = std::exchange(other.store_, nullptr);
    id_ = other.id_;
    tensor_ = std::move(other.tensor_);
  }
  return *this;
}

PinnedObject::~PinnedObject() { Release(); }

void PinnedObject::Release() {
  if (store_ != nullptr) store_->Unpin(id_);
  store_ = nullptr;
  tensor_ = Tensor();
}

ObjectStore::ObjectStore(ObjectStoreOptions options, std::shared_ptr<Allocator> allocator)
    : options_(std::move(options)), allocator_(std::move(allocator)) {
  if (!options_.spill_dir.empty()) {
    std::error_code ignored;
    std::filesystem::create_directories(options_.spill_dir, ignored);
    // Spill files of an earlier store in this directory (a worker that rejoined a restarted
    // scheduler) belong to objects that no longer exist.
    std::filesystem::directory_iterator it(options_.spill_dir, ignored), end;
    for (; !ignored && it != end; it.increment(ignored)) {
      std::error_code not_removed;
      if (it->path().extension() == ".spill") std::filesystem::remove(it->path(), not_removed);
    }
  }
}

ObjectStore::~ObjectStore() {
  MutexLock lock(&mutex_);
  for (auto& [id, entry] : entries_) {
    if (!entry.spill_path.empty()) ::unlink(entry.spill_path.c_str());
  }
}

void ObjectStore::Touch(ObjectId id, Entry& entry) {
  lru_.erase(entry.lru);
  lru_.push_front(id);
  entry.lru = lru_.begin();
}

Status ObjectStore::Put(ObjectId id, Tensor tensor) {
  MutexLock lock(&mutex_);
  if (entries_.contains(id)) return AlreadyExists("object {} is already stored", id.ToString());
  const int64_t bytes = tensor.bytes();
  Entry entry;
  entry.meta = tensor.meta();
  entry.tensor = std::move(tensor);
  if (!entry.meta.device.is_cpu()) {  // the device tier: not in the LRU, never spilled
    entries_.emplace(id, std::move(entry));
    device_bytes_ += bytes;
    return Status::Ok();
  }
  Status room = MakeRoom(bytes);
  auto [it, inserted] = entries_.emplace(id, std::move(entry));
  lru_.push_front(id);
  it->second.lru = lru_.begin();
  host_bytes_ += bytes;
  if (!room.ok()) {
    // It cannot fit in the host tier even after spilling everything else: keep it on disk.
    Status spilled = SpillToDisk(id, it->second);
    if (!spilled.ok()) {
      host_bytes_ -= bytes;
      lru_.erase(it->second.lru);
      entries_.erase(it);
      return spilled.WithContext(room.message());
    }
  }
  return Status::Ok();
}

Status ObjectStore::MakeRoom(int64_t bytes) {
  if (host_bytes_ + bytes <= options_.host_capacity_bytes) return Status::Ok();
  if (options_.spill_dir.empty()) {
    return ResourceExhausted(
        "host tier full: {} bytes needed, {} of {} used, and no spill directory is set", bytes,
        host_bytes_, options_.host_capacity_bytes);
  }
  // Choose the victims first (least recently used, unpinned), then spill them: spilling edits
  // the LRU list being walked.
  std::vector<ObjectId> victims;
  int64_t freed = 0;
  for (auto it = lru_.rbegin();
       it != lru_.rend() && host_bytes_ - freed + bytes > options_.host_capacity_bytes; ++it) {
    const Entry& entry = entries_.at(*it);
    if (entry.pins > 0) continue;
    victims.push_back(*it);
    freed += entry.tensor.bytes();
  }
  if (host_bytes_ - freed + bytes > options_.host_capacity_bytes) {
    return ResourceExhausted(
        "host tier cannot take {} bytes: {} of {} bytes are held by pinned objects", bytes,
        host_bytes_ - freed, options_.host_capacity_bytes);
  }
  for (ObjectId victim : victims) TESSERA_RETURN_IF_ERROR(SpillToDisk(victim, entries_.at(victim)));
  return Status::Ok();
}

Status ObjectStore::SpillToDisk(ObjectId id, Entry& entry) {
  if (options_.spill_dir.empty()) {
    return ResourceExhausted("cannot spill {}: no spill directory is set", id.ToString());
  }
  const int64_t bytes = entry.tensor.bytes();
  std::string contents(kSpillHeaderBytes + static_cast<size_t>(bytes), '\0');
  const auto* payload = static_cast<const uint8_t*>(entry.tensor.raw_data());
  const uint64_t header[3] = {kSpillMagic, static_cast<uint64_t>(bytes),
                              Fnv1aWords(payload, static_cast<size_t>(bytes))};
  std::memcpy(contents.data(), header, kSpillHeaderBytes);
  std::memcpy(contents.data() + kSpillHeaderBytes, payload, static_cast<size_t>(bytes));
  const std::string path = fmt::format("{}/{}.spill", options_.spill_dir, id.ToString());
  TESSERA_RETURN_IF_ERROR(
      WriteFileAtomically(path, contents).WithContext("spilling " + id.ToString()));
  entry.spill_path = path;
  entry.tensor = Tensor();
  lru_.erase(entry.lru);
  host_bytes_ -= bytes;
  spilled_bytes_ += bytes;
  spilled_total_bytes_ += bytes;
  ++spills_;
  return Status::Ok();
}

Result<Tensor> ObjectStore::ReadSpillFile(const Entry& entry) const {
  std::ifstream file(entry.spill_path, std::ios::binary);
  if (!file) {
    return DataLoss("spill file '{}' is missing: {}", entry.spill_path, std::strerror(errno));
  }
  uint64_t header[3];
  file.read(reinterpret_cast<char*>(header), kSpillHeaderBytes);
  const auto bytes = static_cast<uint64_t>(entry.meta.bytes());
  if (!file || header[0] != kSpillMagic || header[1] != bytes) {
    return DataLoss("spill file '{}' has a bad header (expected {} bytes)", entry.spill_path,
                    bytes);
  }
  TESSERA_ASSIGN_OR_RETURN(Tensor tensor, Tensor::Empty(entry.meta, allocator_));
  file.read(static_cast<char*>(tensor.raw_data()), static_cast<std::streamsize>(bytes));
  if (static_cast<uint64_t>(file.gcount()) != bytes) {
    return DataLoss("spill file '{}' is truncated: {} of {} bytes", entry.spill_path, file.gcount(),
                    bytes);
  }
  if (Fnv1aWords(tensor.raw_data(), bytes) != header[2]) {
    return DataLoss("spill file '{}' is corrupt (checksum mismatch)", entry.spill_path);
  }
  return tensor;
}

Result<PinnedObject> ObjectStore::Get(ObjectId id) {
  MutexLock lock(&mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return NotFound("object {} is not in this store", id.ToString());
  Entry& entry = it->second;
  if (!entry.meta.device.is_cpu()) {
    ++entry.pins;
    return PinnedObject(this, id, entry.tensor);
  }
  if (!entry.tensor.defined()) {
    const int64_t bytes = entry.meta.bytes();
    TESSERA_RETURN_IF_ERROR(MakeRoom(bytes).WithContext("restoring " + id.ToString()));
    TESSERA_ASSIGN_OR_RETURN(entry.tensor, ReadSpillFile(entry));
    ::unlink(entry.spill_path.c_str());
    entry.spill_path.clear();
    spilled_bytes_ -= bytes;
    host_bytes_ += bytes;
    ++restores_;
    lru_.push_front(id);
    entry.lru = lru_.begin();
  } else {
    Touch(id, entry);
  }
  ++entry.pins;
  return PinnedObject(this, id, entry.tensor);
}

void ObjectStore::Unpin(ObjectId id) {
  MutexLock lock(&mutex_);
  auto it = entries_.find(id);
  if (it != entries_.end() && it->second.pins > 0) --it->second.pins;
}

Status ObjectStore::Delete(ObjectId id) {
  MutexLock lock(&mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return NotFound("object {} is not in this store", id.ToString());
  Entry& entry = it->second;
  if (!entry.meta.device.is_cpu()) {
    device_bytes_ -= entry.meta.bytes();
  } else if (entry.tensor.defined()) {
    host_bytes_ -= entry.tensor.bytes();
    lru_.erase(entry.lru);
  } else {
    spilled_bytes_ -= entry.meta.bytes();
    ::unlink(entry.spill_path.c_str());
  }
  entries_.erase(it);
  return Status::Ok();
}

bool ObjectStore::Contains(ObjectId id) const {
  MutexLock lock(&mutex_);
  return entries_.contains(id);
}

Result<StorageTier> ObjectStore::TierOf(ObjectId id) const {
  MutexLock lock(&mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return NotFound("object {} is not in this store", id.ToString());
  if (!it->second.meta.device.is_cpu()) return StorageTier::kDevice;
  return it->second.tensor.defined() ? StorageTier::kHost : StorageTier::kDisk;
}

ObjectStoreStats ObjectStore::stats() const {
  MutexLock lock(&mutex_);
  return ObjectStoreStats{.host_bytes = host_bytes_,
                          .host_capacity_bytes = options_.host_capacity_bytes,
                          .spilled_bytes = spilled_bytes_,
                          .objects = static_cast<int64_t>(entries_.size()),
                          .spills = spills_,
                          .spilled_total_bytes = spilled_total_bytes_,
                          .restores = restores_,
                          .device_bytes = device_bytes_};
}

}  // namespace tessera
