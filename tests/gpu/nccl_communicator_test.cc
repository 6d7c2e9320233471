// The NCCL backend on a GPU: a one-rank communicator runs every op on device buffers, and its
// collectives are ordered with the compute stream by events. Skips with the reason where there
// is no GPU or no NCCL library.
#include <cuda_runtime_api.h>

#include <cstring>

#include "collectives/collective_suite.h"
#include "collectives/nccl_communicator.h"
#include "collectives/socket_rendezvous.h"
#include "core/cuda_device.h"
#include "core/half.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const CudaDevices probe = ProbeCudaDevices();
    if (probe.devices.empty()) GTEST_SKIP() << "no usable CUDA device: " << probe.reason;
    Result<std::string> version = NcclVersion();
    if (!version.ok()) GTEST_SKIP() << version.status().ToString();
    std::printf("NCCL %s on %s\n", version->c_str(), probe.devices[0].name.c_str());
    auto rendezvous = JoinSocketRendezvous({"unix:" + TempPath("nccl.sock"), 0, 1});
    ASSERT_OK(rendezvous.status());
    rendezvous_ = std::move(*rendezvous);
    auto communicator = ConnectNcclCommunicator(*rendezvous_);
    ASSERT_OK(communicator.status());
    communicator_ = std::move(*communicator);
  }

  std::unique_ptr<Rendezvous> rendezvous_;
  std::unique_ptr<DeviceCommunicator> communicator_;
};

// A device buffer holding rank 0's reference inputs.
struct DeviceBuffer {
  DeviceBuffer(int64_t count, DType dtype) : bytes(count * DTypeSize(dtype)) {
    cudaMalloc(&data, static_cast<size_t>(std::max<int64_t>(bytes, 1)));
  }
  ~DeviceBuffer() { cudaFree(data); }
  void* data = nullptr;
  int64_t bytes;
};

std::vector<char> HostInputs(int64_t count, DType dtype) {
  std::vector<char> host(static_cast<size_t>(count * DTypeSize(dtype)));
  for (int64_t i = 0; i < count; ++i) {
    const double v = CollectiveInput(0, i, dtype);
    switch (dtype) {
      case DType::kF32: {
        const float f = static_cast<float>(v);
        std::memcpy(host.data() + i * 4, &f, 4);
        break;
      }
      case DType::kI32: {
        const int32_t n = static_cast<int32_t>(v);
        std::memcpy(host.data() + i * 4, &n, 4);
        break;
      }
      default: {
        const uint16_t h = dtype == DType::kBF16 ? FloatToBf16(static_cast<float>(v))
                                                 : FloatToHalf(static_cast<float>(v));
        std::memcpy(host.data() + i * 2, &h, 2);
      }
    }
  }
  return host;
}

// With one rank every collective leaves the data as it was (sum, avg, max and min of one value
// is that value), moved where the op puts it.
TEST_F(NcclTest, OneRankRunsEveryOpAndDtypeOnDeviceBuffers) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32}) {
    for (int64_t count : {int64_t{1}, int64_t{1021}, int64_t{1} << 20}) {
      const std::vector<char> inputs = HostInputs(count, dtype);
      DeviceBuffer a(count, dtype), b(count, dtype);
      std::vector<char> out(inputs.size());
      auto check = [&](const char* what) {
        ASSERT_OK(communicator_->Synchronize());
        ASSERT_CUDA(cudaMemcpy(out.data(), b.data, out.size(), cudaMemcpyDeviceToHost));
        EXPECT_EQ(out, inputs) << what << " of " << count << " x " << DTypeName(dtype);
      };
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
        ASSERT_CUDA(cudaMemcpy(b.data, inputs.data(), inputs.size(), cudaMemcpyHostToDevice));
        ASSERT_OK(communicator_->AllReduce(b.data, count, dtype, op));
        check("all-reduce");
      }
      ASSERT_CUDA(cudaMemcpy(a.data, inputs.data(), inputs.size(), cudaMemcpyHostToDevice));
      ASSERT_CUDA(cudaMemset(b.data, 0, inputs.size()));
      ASSERT_OK(communicator_->ReduceScatter(a.data, b.data, count, dtype, ReduceOp::kSum));
      check("reduce-scatter");
      ASSERT_CUDA(cudaMemset(b.data, 0, inputs.size()));
      ASSERT_OK(communicator_->AllGather(a.data, b.data, count, dtype));
      check("all-gather");
      ASSERT_CUDA(cudaMemset(b.data, 0, inputs.size()));
      ASSERT_OK(communicator_->AllToAll(a.data, b.data, count, dtype));
      check("all-to-all");
      ASSERT_CUDA(cudaMemset(b.data, 0, inputs.size()));
      ASSERT_OK(communicator_->Reduce(a.data, b.data, count, dtype, ReduceOp::kMax, 0));
      check("reduce");
      ASSERT_CUDA(cudaMemcpy(b.data, inputs.data(), inputs.size(), cudaMemcpyHostToDevice));
      ASSERT_OK(communicator_->Broadcast(b.data, count, dtype, 0));
      check("broadcast");
    }
  }
}

// The compute stream is kept busy with large copies, then writes the input; the collective runs
// on the communicator's own stream and must start only after that write (an event), and the
// compute stream's read-back must wait for the collective (another event).
TEST_F(NcclTest, CollectivesAreOrderedWithTheComputeStreamByEvents) {
  cudaStream_t compute;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  communicator_->SetComputeStream(compute);
  const int64_t busy_bytes = int64_t{1} << 30, count = 1 << 22;
  void *busy_from, *busy_to;
  ASSERT_CUDA(cudaMalloc(&busy_from, busy_bytes));
  ASSERT_CUDA(cudaMalloc(&busy_to, busy_bytes));
  DeviceBuffer send(count, DType::kI32), recv(count, DType::kI32);
  std::vector<int32_t> host(static_cast<size_t>(count));
  for (int round = 1; round <= 5; ++round) {
    ASSERT_CUDA(cudaMemsetAsync(recv.data, 0, static_cast<size_t>(recv.bytes), compute));
    for (int i = 0; i < 4; ++i) {
      ASSERT_CUDA(
          cudaMemcpyAsync(busy_to, busy_from, busy_bytes, cudaMemcpyDeviceToDevice, compute));
    }
    ASSERT_CUDA(cudaMemsetAsync(send.data, round, static_cast<size_t>(send.bytes), compute));
    ASSERT_OK(communicator_->AllGather(send.data, recv.data, count, DType::kI32));
    ASSERT_CUDA(cudaMemcpyAsync(host.data(), recv.data, static_cast<size_t>(recv.bytes),
                                cudaMemcpyDeviceToHost, compute));
    ASSERT_CUDA(cudaStreamSynchronize(compute));
    int32_t expected;
    std::memset(&expected, round, sizeof(expected));
    for (int64_t i = 0; i < count; i += 4093) {
      ASSERT_EQ(host[static_cast<size_t>(i)], expected) << "round " << round << ", element " << i;
    }
  }
  communicator_->SetComputeStream(nullptr);
  cudaFree(busy_from);
  cudaFree(busy_to);
  cudaStreamDestroy(compute);
}

TEST_F(NcclTest, AllToAllRefusesOverlappingBuffers) {
  DeviceBuffer buffer(8, DType::kF32);
  char* base = static_cast<char*>(buffer.data);
  Status status = communicator_->AllToAll(base, base + 4, 4, DType::kF32);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("overlap"), std::string::npos) << status.ToString();
}

TEST_F(NcclTest, AnAbortedCommunicatorFailsWithTheReason) {
  DeviceBuffer buffer(16, DType::kF32);
  communicator_->Abort(Unavailable("rank 1 died"));
  Status status = communicator_->AllReduce(buffer.data, 16, DType::kF32, ReduceOp::kSum);
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
  EXPECT_NE(status.message().find("rank 1 died"), std::string::npos) << status.ToString();
}

}  // namespace
}  // namespace tessera::testing
