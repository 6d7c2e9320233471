// The worker's tiered object store: capacity, LRU spilling, pins, restore and damaged files.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "fake_device.h"
#include "test_util.h"
#include "worker/object_store.h"

namespace tessera::testing {
namespace {

constexpr int64_t kFloats = 1 << 18;  // 1 MiB objects
constexpr int64_t kBytes = kFloats * 4;

Tensor Filled(float value) {
  Tensor t = RandomTensor({kFloats}, 0);
  std::fill(t.data<float>(), t.data<float>() + kFloats, value);
  return t;
}

std::string SpillDir(const std::string& name) {
  std::string dir = TempPath("tessera_spill_" + name);
  std::filesystem::remove_all(dir);
  return dir;
}

ObjectStore MakeStore(int64_t capacity, const std::string& spill_dir) {
  return ObjectStore(ObjectStoreOptions{capacity, spill_dir}, TestAllocator());
}

// The one spill file in `dir` (a test failure and "" unless there is exactly one).
std::string OnlySpillFile(const std::string& dir) {
  std::vector<std::string> found;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() == ".spill") found.push_back(entry.path().string());
  }
  EXPECT_EQ(found.size(), 1u) << dir;
  return found.size() == 1 ? found[0] : "";
}

TEST(ObjectStoreTest, PutGetDeleteAndErrors) {
  ObjectStore store = MakeStore(10 * kBytes, SpillDir("basic"));
  ASSERT_OK(store.Put(ObjectId(1), Filled(1)));
  EXPECT_EQ(store.Put(ObjectId(1), Filled(2)).code(), StatusCode::kAlreadyExists);
  ASSERT_OK_AND_ASSIGN(PinnedObject object, store.Get(ObjectId(1)));
  EXPECT_EQ(object.tensor().data<float>()[123], 1.0f);
  EXPECT_EQ(store.Get(ObjectId(9)).status().code(), StatusCode::kNotFound);
  ASSERT_OK(store.Delete(ObjectId(1)));
  EXPECT_FALSE(store.Contains(ObjectId(1)));
  EXPECT_EQ(store.stats().host_bytes, 0);
  EXPECT_EQ(store.Delete(ObjectId(1)).code(), StatusCode::kNotFound);
}

// A GPU worker's objects on its GPU: the device tier, outside the host tier's capacity, never
// spilled, handed out as they are.
TEST(ObjectStoreTest, DeviceObjectsStayInTheDeviceTierAndAreNeverSpilled) {
  FakeDevice gpu;
  ObjectStore store = MakeStore(2 * kBytes, SpillDir("device"));
  const TensorMeta on_gpu{Shape{kFloats}, DType::kF32, Device::Cuda(0)};
  for (uint64_t id = 1; id <= 3; ++id) {  // three objects, more than the host tier's capacity
    ASSERT_OK_AND_ASSIGN(Tensor tensor, Tensor::Empty(on_gpu, gpu.allocator()));
    ASSERT_OK(store.Put(ObjectId(id), std::move(tensor)));
  }
  ASSERT_OK(store.Put(ObjectId(4), Filled(4)));
  ASSERT_OK(store.Put(ObjectId(5), Filled(5)));
  ASSERT_OK(store.Put(ObjectId(6), Filled(6)));  // spills 4, not a device object
  ObjectStoreStats stats = store.stats();
  EXPECT_EQ(stats.device_bytes, 3 * kBytes);
  EXPECT_EQ(stats.host_bytes, 2 * kBytes);
  EXPECT_EQ(stats.spills, 1);
  for (uint64_t id = 1; id <= 3; ++id) {
    ASSERT_OK_AND_ASSIGN(StorageTier tier, store.TierOf(ObjectId(id)));
    EXPECT_EQ(tier, StorageTier::kDevice);
  }
  ASSERT_OK_AND_ASSIGN(StorageTier spilled, store.TierOf(ObjectId(4)));
  EXPECT_EQ(spilled, StorageTier::kDisk);
  ASSERT_OK_AND_ASSIGN(PinnedObject object, store.Get(ObjectId(2)));
  EXPECT_EQ(object.tensor().meta().device, Device::Cuda(0));
  ASSERT_OK(store.Delete(ObjectId(1)));
  EXPECT_EQ(store.stats().device_bytes, 2 * kBytes);
}

TEST(ObjectStoreTest, SpillsLeastRecentlyUsedAndRestoresContents) {
  ObjectStore store = MakeStore(3 * kBytes, SpillDir("lru"));
  for (int i = 1; i <= 3; ++i) ASSERT_OK(store.Put(ObjectId(i), Filled(static_cast<float>(i))));
  { ASSERT_OK_AND_ASSIGN(PinnedObject touched, store.Get(ObjectId(1))); }  // 2 is now the oldest
  ASSERT_OK(store.Put(ObjectId(4), Filled(4)));
  EXPECT_EQ(*store.TierOf(ObjectId(2)), StorageTier::kDisk);
  EXPECT_EQ(*store.TierOf(ObjectId(1)), StorageTier::kHost);
  ObjectStoreStats stats = store.stats();
  EXPECT_EQ(stats.host_bytes, 3 * kBytes);
  EXPECT_EQ(stats.spilled_bytes, kBytes);
  EXPECT_EQ(stats.spills, 1);
  // Every object reads back intact, whichever tier it was in; restores spill others in turn.
  for (int i = 1; i <= 4; ++i) {
    ASSERT_OK_AND_ASSIGN(PinnedObject object, store.Get(ObjectId(i)));
    const float* data = object.tensor().data<float>();
    EXPECT_EQ(data[0], static_cast<float>(i));
    EXPECT_EQ(data[kFloats - 1], static_cast<float>(i));
  }
  EXPECT_GE(store.stats().restores, 1);
  EXPECT_LE(store.stats().host_bytes, 3 * kBytes);
  // The restores spilled others: the bytes written so far count every spill, what is on disk
  // now only the latest.
  stats = store.stats();
  EXPECT_EQ(stats.spilled_total_bytes, stats.spills * kBytes);
  EXPECT_GT(stats.spilled_total_bytes, stats.spilled_bytes);
}

// A worker that rejoins a restarted scheduler starts a new store in the same directory: the
// spill files of the old one belong to objects that no longer exist, and are removed.
TEST(ObjectStoreTest, SpillFilesOfAnEarlierStoreAreRemoved) {
  const std::string dir = SpillDir("earlier");
  {
    ObjectStore earlier = MakeStore(kBytes, dir);
    ASSERT_OK(earlier.Put(ObjectId(1), Filled(1)));
    ASSERT_OK(earlier.Put(ObjectId(2), Filled(2)));  // spills 1
    ASSERT_EQ(earlier.stats().spills, 1);
  }
  std::ofstream(dir + "/notes.txt") << "not a spill file\n";
  // A store that ended without its destructor (a killed process) leaves its spill files.
  std::ofstream(dir + "/7.spill") << "left by a killed worker";
  ObjectStore store = MakeStore(kBytes, dir);
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    EXPECT_NE(entry.path().extension(), ".spill") << entry.path();
  }
  EXPECT_TRUE(std::filesystem::exists(dir + "/notes.txt"));
  ASSERT_OK(store.Put(ObjectId(1), Filled(3)));
  ASSERT_OK(store.Put(ObjectId(2), Filled(4)));  // spills 1 again, into a fresh file
  ASSERT_OK_AND_ASSIGN(PinnedObject object, store.Get(ObjectId(1)));
  EXPECT_EQ(object.tensor().data<float>()[0], 3.0f);
}

TEST(ObjectStoreTest, PinnedObjectsStayInHostMemory) {
  ObjectStore store = MakeStore(2 * kBytes, SpillDir("pins"));
  ASSERT_OK(store.Put(ObjectId(1), Filled(1)));
  ASSERT_OK(store.Put(ObjectId(2), Filled(2)));
  ASSERT_OK_AND_ASSIGN(PinnedObject a, store.Get(ObjectId(1)));
  ASSERT_OK_AND_ASSIGN(PinnedObject b, store.Get(ObjectId(2)));
  // Both pinned: a third object cannot enter the host tier, so it goes straight to disk.
  ASSERT_OK(store.Put(ObjectId(3), Filled(3)));
  EXPECT_EQ(*store.TierOf(ObjectId(3)), StorageTier::kDisk);
  Result<PinnedObject> blocked = store.Get(ObjectId(3));
  ASSERT_FALSE(blocked.ok());
  EXPECT_EQ(blocked.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(blocked.status().message().find("pinned"), std::string::npos);
  b = PinnedObject();  // unpin 2: now 3 can come back by spilling 2
  ASSERT_OK_AND_ASSIGN(PinnedObject c, store.Get(ObjectId(3)));
  EXPECT_EQ(c.tensor().data<float>()[7], 3.0f);
  EXPECT_EQ(*store.TierOf(ObjectId(2)), StorageTier::kDisk);
  EXPECT_EQ(*store.TierOf(ObjectId(1)), StorageTier::kHost);
}

TEST(ObjectStoreTest, DamagedSpillFilesAreDataLoss) {
  const std::string dir = SpillDir("damaged");
  ObjectStore store = MakeStore(kBytes, dir);
  ASSERT_OK(store.Put(ObjectId(1), Filled(1)));
  ASSERT_OK(store.Put(ObjectId(2), Filled(2)));  // spills 1
  const std::string path = OnlySpillFile(dir);
  ASSERT_FALSE(path.empty());
  {
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(1000);
    file.put('\x7f');
  }
  Result<PinnedObject> corrupt = store.Get(ObjectId(1));
  ASSERT_FALSE(corrupt.ok());
  EXPECT_EQ(corrupt.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(corrupt.status().message().find("checksum"), std::string::npos);
  std::filesystem::resize_file(path, 4096);
  Result<PinnedObject> truncated = store.Get(ObjectId(1));
  ASSERT_FALSE(truncated.ok());
  EXPECT_NE(truncated.status().message().find("truncated"), std::string::npos);
}

// A store of capacity two objects holding objects 1 and 2, and a thread putting object 3, whose
// room comes from spilling 1 into a FIFO nobody reads yet: the write waits, so the spill stays in
// flight until Drain() reads the FIFO (returning what was written) and the Put returns.
class SpillIntoFifo {
 public:
  explicit SpillIntoFifo(const std::string& name)
      : dir_(SpillDir(name)), store_(MakeStore(2 * kBytes, dir_)) {
    EXPECT_OK(store_.Put(ObjectId(1), Filled(1)));
    EXPECT_OK(store_.Put(ObjectId(2), Filled(2)));
    // The first entry of object 1 is the store's first: its spill file's name (SpillPath).
    fifo_ = dir_ + "/" + ObjectId(1).ToString() + "-1.spill";
    EXPECT_EQ(::mkfifo(fifo_.c_str(), 0600), 0) << fifo_;
    putter_ = std::thread([this] { put3_ = store_.Put(ObjectId(3), Filled(3)); });
    while (store_.stats().spilling_bytes == 0) std::this_thread::yield();
  }
  ~SpillIntoFifo() {
    if (putter_.joinable()) Drain();
  }
  std::string Drain() {
    std::string written;
    {
      std::ifstream reader(fifo_, std::ios::binary);
      written.assign(std::istreambuf_iterator<char>(reader), std::istreambuf_iterator<char>());
    }
    putter_.join();
    EXPECT_OK(put3_);
    return written;
  }
  ObjectStore& store() { return store_; }
  const std::string& fifo() const { return fifo_; }

 private:
  std::string dir_;
  ObjectStore store_;
  std::string fifo_;
  Status put3_;
  std::thread putter_;
};

// A spill is written outside the store's lock: while one is in flight, stats, lookups, Gets of
// other objects and of the one being spilled all go on. A worker's heartbeat reads stats() on its
// I/O thread: with the old store, a spill of gigabytes held it past the scheduler's heartbeat
// timeout.
TEST(ObjectStoreTest, ASpillInFlightBlocksNoOtherCaller) {
  SpillIntoFifo spill("in_flight");
  ObjectStore& store = spill.store();
  EXPECT_EQ(store.stats().spilling_bytes, kBytes);
  EXPECT_TRUE(store.Contains(ObjectId(1)));
  EXPECT_EQ(*store.TierOf(ObjectId(1)), StorageTier::kHost);
  {
    ASSERT_OK_AND_ASSIGN(PinnedObject two, store.Get(ObjectId(2)));
    EXPECT_EQ(two.tensor().data<float>()[5], 2.0f);
  }
  {
    ASSERT_OK_AND_ASSIGN(PinnedObject one, store.Get(ObjectId(1)));  // still in memory
    EXPECT_EQ(one.tensor().data<float>()[5], 1.0f);
  }
  // The spill completes, the Put that needed the room returns.
  EXPECT_EQ(spill.Drain().size(), static_cast<size_t>(kBytes) + 24);  // the header, the payload
  const ObjectStoreStats stats = store.stats();
  EXPECT_EQ(stats.spilling_bytes, 0);
  EXPECT_EQ(stats.spills, 1);
  EXPECT_EQ(stats.host_bytes, 2 * kBytes);
  EXPECT_EQ(*store.TierOf(ObjectId(1)), StorageTier::kDisk);
}

// An object handed out while its spill is written stays in memory (the file is dropped, and the
// room is made by spilling another); one deleted meanwhile leaves no file behind.
TEST(ObjectStoreTest, AnObjectUsedOrDeletedWhileSpilledStaysOrGoesWhole) {
  for (const bool delete_it : {false, true}) {
    SCOPED_TRACE(delete_it ? "deleted while spilled" : "used while spilled");
    SpillIntoFifo spill(delete_it ? "deleted_in_flight" : "used_in_flight");
    ObjectStore& store = spill.store();
    PinnedObject held;
    if (delete_it) {
      ASSERT_OK(store.Delete(ObjectId(1)));
    } else {
      ASSERT_OK_AND_ASSIGN(held, store.Get(ObjectId(1)));
    }
    spill.Drain();
    const ObjectStoreStats stats = store.stats();
    EXPECT_EQ(stats.spilling_bytes, 0);
    EXPECT_FALSE(std::filesystem::exists(spill.fifo()));
    EXPECT_EQ(stats.host_bytes, 2 * kBytes);
    if (delete_it) {  // its going made the room
      EXPECT_FALSE(store.Contains(ObjectId(1)));
      EXPECT_EQ(stats.spills, 0);
      EXPECT_EQ(*store.TierOf(ObjectId(2)), StorageTier::kHost);
    } else {  // it stayed, so the Put that needed room spilled the next least recently used
      EXPECT_EQ(*store.TierOf(ObjectId(1)), StorageTier::kHost);
      EXPECT_EQ(held.tensor().data<float>()[9], 1.0f);
      EXPECT_EQ(stats.spills, 1);
      EXPECT_EQ(*store.TierOf(ObjectId(2)), StorageTier::kDisk);
      ASSERT_OK_AND_ASSIGN(PinnedObject two, store.Get(ObjectId(2)));
      EXPECT_EQ(two.tensor().data<float>()[9], 2.0f);
    }
  }
}

TEST(ObjectStoreTest, WithoutASpillDirectoryAFullHostTierIsRefused) {
  ObjectStore store = MakeStore(kBytes, "");
  ASSERT_OK(store.Put(ObjectId(1), Filled(1)));
  Status full = store.Put(ObjectId(2), Filled(2));
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("no spill directory"), std::string::npos);
  EXPECT_FALSE(store.Contains(ObjectId(2)));
}

}  // namespace
}  // namespace tessera::testing
