#include "worker/object_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

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

ObjectStore::Entry* ObjectStore::FindCurrent(ObjectId id, uint64_t serial) {
  auto it = entries_.find(id);
  return it == entries_.end() || it->second.serial != serial ? nullptr : &it->second;
}

std::string ObjectStore::SpillPath(ObjectId id, uint64_t serial) const {
  return fmt::format("{}/{}-{}.spill", options_.spill_dir, id.ToString(), serial);
}

Status ObjectStore::Put(ObjectId id, Tensor tensor) {
  MutexLock lock(&mutex_);
  if (entries_.contains(id)) return AlreadyExists("object {} is already stored", id.ToString());
  const int64_t bytes = tensor.bytes();
  Entry entry;
  entry.meta = tensor.meta();
  entry.tensor = std::move(tensor);
  entry.serial = next_serial_++;
  const uint64_t serial = entry.serial;
  if (!entry.meta.device.is_cpu()) {  // the device tier: not in the LRU, never spilled
    entry.state = State::kDevice;
    entries_.emplace(id, std::move(entry));
    device_bytes_ += bytes;
    return Status::Ok();
  }
  // In the host tier at once (no other Put of the id can start), pinned while room is made so
  // that it is not chosen to make its own.
  entry.pins = 1;
  auto [it, inserted] = entries_.emplace(id, std::move(entry));
  lru_.push_front(id);
  it->second.lru = lru_.begin();
  host_bytes_ += bytes;
  const Status room = MakeRoom(bytes);
  Entry* placed = FindCurrent(id, serial);
  if (placed == nullptr) return Status::Ok();  // deleted meanwhile
  --placed->pins;
  if (room.ok()) return Status::Ok();
  // It cannot fit in the host tier even after spilling everything else: keep it on disk.
  const Status spilled = Spill({id});
  if (!spilled.ok()) {
    if (Entry* kept = FindCurrent(id, serial); kept != nullptr && kept->state == State::kHost) {
      host_bytes_ -= bytes;
      lru_.erase(kept->lru);
      entries_.erase(id);
    }
    return spilled.WithContext(room.message());
  }
  return Status::Ok();
}

Status ObjectStore::MakeRoom(int64_t bytes) {
  const int64_t capacity = options_.host_capacity_bytes;
  for (;;) {
    if (host_bytes_ <= capacity) return Status::Ok();
    if (options_.spill_dir.empty()) {
      return ResourceExhausted(
          "host tier full: {} bytes needed, {} of {} used, and no spill directory is set", bytes,
          host_bytes_ - bytes, capacity);
    }
    // What spills in flight will free counts as free; then the least recently used unpinned
    // objects, chosen before any is spilled (spilling edits the list being walked).
    std::vector<ObjectId> victims;
    int64_t freed = spilling_bytes_;
    for (auto it = lru_.rbegin(); it != lru_.rend() && host_bytes_ - freed > capacity; ++it) {
      const Entry& entry = entries_.at(*it);
      if (entry.pins > 0) continue;
      victims.push_back(*it);
      freed += entry.tensor.bytes();
    }
    if (host_bytes_ - freed > capacity) {
      return ResourceExhausted(
          "host tier cannot take {} bytes: {} of {} bytes are held by pinned objects", bytes,
          host_bytes_ - freed - bytes, capacity);
    }
    if (victims.empty()) {
      io_done_.Wait(&mutex_);  // others' spills will make the room
    } else {
      TESSERA_RETURN_IF_ERROR(Spill(victims));
    }
  }
}

namespace {

// Writes all of `data`; the system error otherwise.
Status WriteAll(int fd, const void* data, size_t size, const std::string& path) {
  const auto* at = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, at, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return Unavailable("cannot write spill file '{}': {} (free space in the spill directory)",
                         path, n < 0 ? std::strerror(errno) : "nothing written");
    }
    at += n;
    size -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status WriteSpillFile(const std::string& path, const Tensor& tensor) {
  const auto bytes = static_cast<size_t>(tensor.bytes());
  const uint64_t header[3] = {kSpillMagic, static_cast<uint64_t>(bytes),
                              Fnv1aWords(tensor.raw_data(), bytes)};
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    return Unavailable("cannot create spill file '{}': {}", path, std::strerror(errno));
  }
  Status written = WriteAll(fd, header, kSpillHeaderBytes, path);
  if (written.ok()) written = WriteAll(fd, tensor.raw_data(), bytes, path);
  if (::close(fd) != 0 && written.ok()) {
    written = Unavailable("cannot write spill file '{}': {}", path, std::strerror(errno));
  }
  if (!written.ok()) ::unlink(path.c_str());
  return written;
}

}  // namespace

Status ObjectStore::Spill(const std::vector<ObjectId>& ids) {
  if (options_.spill_dir.empty()) {
    return ResourceExhausted("cannot spill {}: no spill directory is set", ids.front().ToString());
  }
  struct Write {
    ObjectId id;
    uint64_t serial;
    Tensor tensor;  // shares the entry's memory
    std::string path;
    Status written;
  };
  std::vector<Write> writes;
  writes.reserve(ids.size());
  for (ObjectId id : ids) {
    Entry& entry = entries_.at(id);
    entry.state = State::kSpilling;
    lru_.erase(entry.lru);
    spilling_bytes_ += entry.tensor.bytes();
    writes.push_back(
        Write{id, entry.serial, entry.tensor, SpillPath(id, entry.serial), Status::Ok()});
  }
  mutex_.Unlock();
  for (Write& write : writes) {
    write.written =
        WriteSpillFile(write.path, write.tensor).WithContext("spilling " + write.id.ToString());
  }
  mutex_.Lock();
  Status first_error;
  for (Write& write : writes) {
    const int64_t bytes = write.tensor.bytes();
    Entry* entry = FindCurrent(write.id, write.serial);
    if (entry == nullptr) {  // deleted while written: Delete took it out of the counts
      ::unlink(write.path.c_str());
      continue;
    }
    spilling_bytes_ -= bytes;
    if (!write.written.ok() || entry->pins > 0) {
      // Not written, or handed out meanwhile: it stays in memory, as recently used.
      if (write.written.ok()) ::unlink(write.path.c_str());
      if (first_error.ok()) first_error = write.written;
      entry->state = State::kHost;
      lru_.push_front(write.id);
      entry->lru = lru_.begin();
      continue;
    }
    entry->state = State::kDisk;
    entry->tensor = Tensor();
    entry->spill_path = std::move(write.path);
    host_bytes_ -= bytes;
    spilled_bytes_ += bytes;
    spilled_total_bytes_ += bytes;
    ++spills_;
  }
  io_done_.NotifyAll();
  return first_error;
}

Result<Tensor> ObjectStore::ReadSpillFile(const std::string& path, const TensorMeta& meta) const {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    return DataLoss("spill file '{}' is missing: {}", path, std::strerror(errno));
  }
  uint64_t header[3];
  file.read(reinterpret_cast<char*>(header), kSpillHeaderBytes);
  const auto bytes = static_cast<uint64_t>(meta.bytes());
  if (!file || header[0] != kSpillMagic || header[1] != bytes) {
    return DataLoss("spill file '{}' has a bad header (expected {} bytes)", path, bytes);
  }
  TESSERA_ASSIGN_OR_RETURN(Tensor tensor, Tensor::Empty(meta, allocator_));
  file.read(static_cast<char*>(tensor.raw_data()), static_cast<std::streamsize>(bytes));
  if (static_cast<uint64_t>(file.gcount()) != bytes) {
    return DataLoss("spill file '{}' is truncated: {} of {} bytes", path, file.gcount(), bytes);
  }
  if (Fnv1aWords(tensor.raw_data(), bytes) != header[2]) {
    return DataLoss("spill file '{}' is corrupt (checksum mismatch)", path);
  }
  return tensor;
}

Result<PinnedObject> ObjectStore::Get(ObjectId id) {
  MutexLock lock(&mutex_);
  for (;;) {
    auto it = entries_.find(id);
    if (it == entries_.end()) return NotFound("object {} is not in this store", id.ToString());
    Entry& entry = it->second;
    switch (entry.state) {
      case State::kHost:
        Touch(id, entry);
        [[fallthrough]];
      case State::kDevice:
      case State::kSpilling:  // still in memory; the spill is dropped once written
        ++entry.pins;
        return PinnedObject(this, id, entry.tensor);
      case State::kRestoring:
        io_done_.Wait(&mutex_);
        continue;
      case State::kDisk:
        break;
    }
    // Read it back: its bytes are reserved in the host tier first, room made for them, and the
    // file read outside the lock (other Gets of it wait meanwhile).
    const uint64_t serial = entry.serial;
    const int64_t bytes = entry.meta.bytes();
    const TensorMeta meta = entry.meta;
    const std::string path = entry.spill_path;
    entry.state = State::kRestoring;
    spilled_bytes_ -= bytes;
    host_bytes_ += bytes;
    Result<Tensor> restored = Tensor();
    if (Status room = MakeRoom(bytes); !room.ok()) {
      restored = room.WithContext("restoring " + id.ToString());
    } else {
      mutex_.Unlock();
      restored = ReadSpillFile(path, meta);
      mutex_.Lock();
    }
    Entry* current = FindCurrent(id, serial);
    io_done_.NotifyAll();
    if (current == nullptr) {  // deleted meanwhile (Delete took it out of the counts)
      ::unlink(path.c_str());
      return NotFound("object {} was deleted while it was read back", id.ToString());
    }
    if (!restored.ok()) {  // it stays on disk
      current->state = State::kDisk;
      host_bytes_ -= bytes;
      spilled_bytes_ += bytes;
      return restored.status();
    }
    ::unlink(path.c_str());
    current->spill_path.clear();
    current->tensor = *std::move(restored);
    current->state = State::kHost;
    ++restores_;
    lru_.push_front(id);
    current->lru = lru_.begin();
    ++current->pins;
    return PinnedObject(this, id, current->tensor);
  }
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
  const int64_t bytes = entry.meta.bytes();
  switch (entry.state) {
    case State::kDevice:
      device_bytes_ -= bytes;
      break;
    case State::kHost:
      host_bytes_ -= bytes;
      lru_.erase(entry.lru);
      break;
    case State::kSpilling:  // the writer removes the file when it finds the entry gone
      host_bytes_ -= bytes;
      spilling_bytes_ -= bytes;
      break;
    case State::kRestoring:  // the reader removes the file when it finds the entry gone
      host_bytes_ -= bytes;
      break;
    case State::kDisk:
      spilled_bytes_ -= bytes;
      ::unlink(entry.spill_path.c_str());
      break;
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
  switch (it->second.state) {
    case State::kDevice:
      return StorageTier::kDevice;
    case State::kHost:
    case State::kSpilling:
      return StorageTier::kHost;
    case State::kDisk:
    case State::kRestoring:
      break;
  }
  return StorageTier::kDisk;
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
                          .device_bytes = device_bytes_,
                          .spilling_bytes = spilling_bytes_};
}

}  // namespace tessera
