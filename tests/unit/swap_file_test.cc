// The disk tier: the swap file's regions and copies (direct and buffered, aligned or not), its
// errors, and the executor running copies to and from it on its I/O thread.
#include "worker/swap_file.h"

#include <cstring>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "ops/cpu/cpu_kernels.h"
#include "ops/graph_builder.h"
#include "test_util.h"
#include "worker/in_process_executor.h"

namespace tessera {
namespace {

using testing::RandomTensor;
using testing::TempPath;
using testing::TestAllocator;

std::string SwapDir(const std::string& name) {
  std::string dir = TempPath("tessera_swap_" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::shared_ptr<DeviceRuntime> OpenIn(const std::string& dir, bool direct = true,
                                      int64_t capacity = 0) {
  Result<std::shared_ptr<DeviceRuntime>> file = OpenSwapFile({dir, capacity, direct});
  TESSERA_CHECK(file.ok(), "{}", file.status().ToString());
  return *file;
}

// `floats` values out to the disk from host memory starting `offset` floats into a buffer, and
// back into a fresh buffer: the same bits.
void ExpectRoundTrip(DeviceRuntime& disk, int64_t floats, int64_t offset) {
  Tensor backing = RandomTensor({floats + offset}, static_cast<uint64_t>(floats + offset));
  ASSERT_OK_AND_ASSIGN(Tensor host, backing.View(Shape{floats}, offset));
  const TensorMeta on_disk{Shape{floats}, DType::kF32, Device::Disk()};
  ASSERT_OK_AND_ASSIGN(Tensor region, Tensor::Empty(on_disk, disk.allocator()));
  ASSERT_OK(
      disk.Copy(region.raw_data(), Device::Disk(), host.raw_data(), Device::Cpu(), host.bytes()));
  ASSERT_OK_AND_ASSIGN(Tensor back, Tensor::Zeros(TensorMeta{Shape{floats}}, TestAllocator()));
  ASSERT_OK(
      disk.Copy(back.raw_data(), Device::Cpu(), region.raw_data(), Device::Disk(), host.bytes()));
  EXPECT_EQ(std::memcmp(back.raw_data(), host.raw_data(), static_cast<size_t>(host.bytes())), 0)
      << floats << " floats from offset " << offset;
}

TEST(SwapFileTest, BytesGoOutAndComeBackWhateverTheirSizeAndAlignment) {
  for (const bool direct : {true, false}) {
    std::shared_ptr<DeviceRuntime> disk = OpenIn(SwapDir("round_trip"), direct);
    EXPECT_EQ(disk->device(), Device::Disk());
    if (!direct) {
      EXPECT_FALSE(SwapFileIsDirect(*disk));
    }
    // One float; a tail short of a block; a page-aligned 1 MiB and more; unaligned starts.
    for (const int64_t floats :
         {int64_t{1}, int64_t{1023}, int64_t{1} << 18, (int64_t{1} << 18) + 3, int64_t{300000}}) {
      for (const int64_t offset : {int64_t{0}, int64_t{1}, int64_t{1024}}) {
        ExpectRoundTrip(*disk, floats, offset);
      }
    }
    // Every region went back: nothing is live on the disk.
    EXPECT_EQ(disk->memory().live_bytes, 0);
    EXPECT_GT(disk->memory().peak_bytes, 0);
  }
}

TEST(SwapFileTest, FreedRegionsAreReusedAndTheCapIsKept) {
  constexpr int64_t kBlock = 4096;
  std::shared_ptr<DeviceRuntime> disk = OpenIn(SwapDir("regions"), true, /*capacity=*/3 * kBlock);
  const std::shared_ptr<Allocator>& regions = disk->allocator();
  ASSERT_OK_AND_ASSIGN(void* a, regions->Allocate(kBlock));
  ASSERT_OK_AND_ASSIGN(void* b, regions->Allocate(100));  // rounded up to a block
  ASSERT_OK_AND_ASSIGN(void* c, regions->Allocate(kBlock));
  EXPECT_NE(a, nullptr);
  EXPECT_NE(a, b);
  EXPECT_NE(b, c);
  // The cap: a fourth block does not fit, and the error names the tier and its cap.
  Result<void*> over = regions->Allocate(1);
  ASSERT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("disk"), std::string::npos) << over.status().ToString();
  EXPECT_NE(over.status().message().find("cap"), std::string::npos) << over.status().ToString();
  // A freed region is handed out again (first fit), merged with a freed neighbour.
  regions->Deallocate(a, kBlock);
  regions->Deallocate(b, 100);
  ASSERT_OK_AND_ASSIGN(void* ab, regions->Allocate(2 * kBlock));
  EXPECT_EQ(ab, a);
  EXPECT_EQ(disk->memory().live_bytes, 3 * kBlock);
  regions->Deallocate(ab, 2 * kBlock);
  regions->Deallocate(c, kBlock);
  EXPECT_EQ(disk->memory().live_bytes, 0);
  EXPECT_EQ(disk->memory().peak_bytes, 3 * kBlock);
}

TEST(SwapFileTest, AMissingOrWrongDirectoryIsNamedWithTheFix) {
  Result<std::shared_ptr<DeviceRuntime>> missing =
      OpenSwapFile({TempPath("tessera_swap_nowhere/deeper"), 0, true});
  ASSERT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("tessera_swap_nowhere"), std::string::npos);
  EXPECT_NE(missing.status().message().find("--swap-dir"), std::string::npos);

  const std::string file = SwapDir("not_a_dir") + "/file";
  std::ofstream(file) << "x";
  Result<std::shared_ptr<DeviceRuntime>> not_dir = OpenSwapFile({file, 0, true});
  ASSERT_EQ(not_dir.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(not_dir.status().message().find("not a directory"), std::string::npos);

  EXPECT_EQ(OpenSwapFile({"", 0, true}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenSwapFile({SwapDir("negative"), -1, true}).status().code(),
            StatusCode::kInvalidArgument);
  // The file is unlinked at once: nothing is left in the directory.
  const std::string dir = SwapDir("unlinked");
  std::shared_ptr<DeviceRuntime> disk = OpenIn(dir);
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  // It copies between the host and the disk only.
  float value = 1;
  EXPECT_EQ(disk->Copy(&value, Device::Cuda(0), &value, Device::Cpu(), 4).code(),
            StatusCode::kInvalidArgument);
}

// A step's swap as the memory plan builds it: a host object copied to the disk (a task whose
// outputs the builder puts there), then back, then read. The executor runs both copies on its
// I/O thread (their spans on the slot after the compute slots), the values come back bit for
// bit, and the role meter counts only what is in memory.
TEST(SwapFileTest, TheExecutorRunsSwapsOnItsIoThread) {
  ASSERT_OK_AND_ASSIGN(OpRegistry registry, MakeCpuOpRegistry());
  GraphBuilder builder(registry);
  const TensorMeta meta{Shape{70000}, DType::kF32, Device::Cpu()};
  const ObjectId x = builder.AddInput("x", meta, ObjectRole::kActivation);
  TaskOptions out;
  out.outputs_on_disk = true;
  ASSERT_OK_AND_ASSIGN(auto on_disk, builder.AddTask("swap_out", "copy", {x}, {}, out));
  EXPECT_EQ(builder.meta(on_disk[0]).device, Device::Disk());
  ASSERT_OK_AND_ASSIGN(auto back, builder.AddTask("swap_in", "copy", {on_disk[0]}, {}));
  ASSERT_OK_AND_ASSIGN(auto doubled, builder.AddTask("add", "add_forward", {back[0], back[0]}, {}));
  builder.MarkOutput(doubled[0]);
  // Only a copy may put its outputs on the disk.
  TaskOptions wrong;
  wrong.outputs_on_disk = true;
  EXPECT_EQ(builder.AddTask("bad", "add_forward", {x, x}, {}, wrong).status().code(),
            StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(Graph graph, builder.Build());

  const Tensor input = RandomTensor({70000}, 3);
  for (const bool with_disk : {false, true}) {
    ExecutorOptions options;
    options.threads = 2;
    if (with_disk) options.disk = OpenIn(SwapDir("executor"));
    InProcessExecutor executor(registry, options);
    ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(graph));
    Result<RunResult> result = executor.Run(prepared, {{x, input}});
    if (!with_disk) {
      // Without a swap file the swap fails, naming the flag that gives one.
      ASSERT_FALSE(result.ok());
      EXPECT_NE(result.status().message().find("--swap-dir"), std::string::npos)
          << result.status().ToString();
      continue;
    }
    ASSERT_OK(result.status());
    const Tensor& y = result->outputs.at(doubled[0]);
    for (int64_t i = 0; i < input.numel(); ++i) {
      ASSERT_EQ(y.data<float>()[i], input.data<float>()[i] + input.data<float>()[i]) << i;
    }
    for (const TaskTiming& timing : result->stats.timings) {
      const std::string& name = graph.task(timing.task).name;
      if (name == "add") {
        EXPECT_LT(timing.thread_slot, executor.threads());
      } else {
        EXPECT_EQ(timing.thread_slot, executor.threads()) << name;
        EXPECT_EQ(timing.bytes, meta.bytes()) << name;  // a copy between tiers
      }
    }
    // In memory at most: the input, its copy back, and the sum (never the disk's copy).
    EXPECT_LE(result->stats.role_bytes.total_peak, 3 * meta.bytes());
    EXPECT_EQ(options.disk->memory().peak_bytes, meta.bytes());
    EXPECT_EQ(options.disk->memory().live_bytes, 0);
  }
}

}  // namespace
}  // namespace tessera
