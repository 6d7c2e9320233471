#include "collective_suite.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/half.h"

namespace tessera::testing {

namespace {

constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin};

void Store(char* base, int64_t index, DType dtype, double value) {
  switch (dtype) {
    case DType::kF32: {
      const float v = static_cast<float>(value);
      std::memcpy(base + index * 4, &v, 4);
      return;
    }
    case DType::kI32: {
      const int32_t v = static_cast<int32_t>(value);
      std::memcpy(base + index * 4, &v, 4);
      return;
    }
    case DType::kBF16:
    case DType::kF16: {
      const float f = static_cast<float>(value);
      const uint16_t v = dtype == DType::kBF16 ? FloatToBf16(f) : FloatToHalf(f);
      std::memcpy(base + index * 2, &v, 2);
      return;
    }
    default:
      return;
  }
}

double Load(const char* base, int64_t index, DType dtype) {
  switch (dtype) {
    case DType::kF32: {
      float v;
      std::memcpy(&v, base + index * 4, 4);
      return v;
    }
    case DType::kI32: {
      int32_t v;
      std::memcpy(&v, base + index * 4, 4);
      return v;
    }
    case DType::kBF16:
    case DType::kF16: {
      uint16_t v;
      std::memcpy(&v, base + index * 2, 2);
      return dtype == DType::kBF16 ? Bf16ToFloat(v) : HalfToFloat(v);
    }
    default:
      return 0;
  }
}

double Epsilon(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return std::ldexp(1.0, -8);
    case DType::kF16:
      return std::ldexp(1.0, -10);
    case DType::kF32:
      return std::ldexp(1.0, -22);
    default:
      return 0;
  }
}

// A buffer of `count` elements holding rank `rank`'s inputs from element `offset` on.
std::vector<char> Inputs(int rank, int64_t count, DType dtype, int64_t offset = 0) {
  std::vector<char> buffer(static_cast<size_t>(count * DTypeSize(dtype)));
  for (int64_t i = 0; i < count; ++i) {
    Store(buffer.data(), i, dtype, CollectiveInput(rank, offset + i, dtype));
  }
  return buffer;
}

std::string Describe(std::string_view what, DType dtype, int64_t count) {
  return fmt::format("{} of {} x {}", what, count, DTypeName(dtype));
}

// `actual` (count elements) against op over every rank's inputs from element `offset` on.
Status CheckReduced(const char* actual, int64_t count, DType dtype, ReduceOp op, int ranks,
                    int64_t offset, std::string_view what) {
  for (int64_t i = 0; i < count; ++i) {
    double sum = 0, magnitude = 0, max = -1e300, min = 1e300;
    for (int r = 0; r < ranks; ++r) {
      const double v = CollectiveInput(r, offset + i, dtype);
      sum += v;
      magnitude += std::abs(v);
      max = std::max(max, v);
      min = std::min(min, v);
    }
    double expected = 0, tolerance = 0;
    switch (op) {
      case ReduceOp::kSum:
        expected = sum;
        tolerance = Epsilon(dtype) * (ranks + 1) * magnitude;
        break;
      case ReduceOp::kAvg:
        expected = dtype == DType::kI32 ? std::trunc(sum / ranks) : sum / ranks;
        tolerance = Epsilon(dtype) * (ranks + 2) * magnitude / ranks;
        break;
      case ReduceOp::kMax:
        expected = max;
        break;
      case ReduceOp::kMin:
        expected = min;
        break;
    }
    const double got = Load(actual, i, dtype);
    if (!(std::abs(got - expected) <= tolerance)) {
      return Internal("{} ({}) over {} ranks: element {} is {}, expected {} (tolerance {})",
                      Describe(what, dtype, count), ReduceOpName(op), ranks, i, got, expected,
                      tolerance);
    }
  }
  return Status::Ok();
}

// `actual` (count elements) against rank `rank`'s inputs, exactly.
Status CheckCopied(const char* actual, int64_t count, DType dtype, int rank, int64_t offset,
                   std::string_view what) {
  for (int64_t i = 0; i < count; ++i) {
    const double expected = CollectiveInput(rank, offset + i, dtype);  // exact in every dtype
    const double got = Load(actual, i, dtype);
    if (got != expected) {
      return Internal("{}: element {} is {}, expected rank {}'s {}", Describe(what, dtype, count),
                      i, got, rank, expected);
    }
  }
  return Status::Ok();
}

// All-to-all of `block` elements per pair: rank r sends its inputs 0 .. n*block-1, so block j
// of what it receives must be rank j's inputs from element r*block on. The receive buffer starts
// as 0x7F bytes (a value no input takes), so a block never written is caught.
Status CheckAllToAll(Communicator& comm, DType dtype, int64_t block) {
  const int rank = comm.rank(), n = comm.size();
  const int64_t element = DTypeSize(dtype);
  std::vector<char> send = Inputs(rank, block * n, dtype);
  std::vector<char> recv(static_cast<size_t>(block * n * element), 0x7F);
  TESSERA_RETURN_IF_ERROR(
      comm.AllToAll(send.data(), recv.data(), block, dtype).WithContext("all-to-all"));
  for (int source = 0; source < n; ++source) {
    TESSERA_RETURN_IF_ERROR(CheckCopied(recv.data() + source * block * element, block, dtype,
                                        source, rank * block,
                                        fmt::format("all-to-all block from rank {}", source)));
  }
  return Status::Ok();
}

Status RunOne(Communicator& comm, DType dtype, int64_t count, bool all_ops, bool everything) {
  const int rank = comm.rank(), n = comm.size();
  const int64_t element = DTypeSize(dtype);
  for (ReduceOp op : kOps) {
    if (!all_ops && op != ReduceOp::kSum) continue;
    std::vector<char> buffer = Inputs(rank, count, dtype);
    const std::string what = fmt::format("all-reduce {}", ReduceOpName(op));
    TESSERA_RETURN_IF_ERROR(comm.AllReduce(buffer.data(), count, dtype, op).WithContext(what));
    TESSERA_RETURN_IF_ERROR(CheckReduced(buffer.data(), count, dtype, op, n, 0, "all-reduce"));
  }
  // Reduce-scatter, all-gather and all-to-all take `count` as the whole buffer when it is large.
  const int64_t block = all_ops ? count : count / n;
  // All-to-all copies: cheap enough to run on every dtype at the large size too.
  TESSERA_RETURN_IF_ERROR(CheckAllToAll(comm, dtype, block));
  if (!everything) return Status::Ok();
  for (ReduceOp op : kOps) {
    if (!all_ops && op != ReduceOp::kSum) continue;
    std::vector<char> send = Inputs(rank, block * n, dtype);
    std::vector<char> recv(static_cast<size_t>(block * element));
    TESSERA_RETURN_IF_ERROR(comm.ReduceScatter(send.data(), recv.data(), block, dtype, op)
                                .WithContext("reduce-scatter"));
    TESSERA_RETURN_IF_ERROR(
        CheckReduced(recv.data(), block, dtype, op, n, rank * block, "reduce-scatter"));
  }
  {
    std::vector<char> send = Inputs(rank, block, dtype);
    std::vector<char> recv(static_cast<size_t>(block * n * element));
    TESSERA_RETURN_IF_ERROR(
        comm.AllGather(send.data(), recv.data(), block, dtype).WithContext("all-gather"));
    for (int r = 0; r < n; ++r) {
      TESSERA_RETURN_IF_ERROR(
          CheckCopied(recv.data() + r * block * element, block, dtype, r, 0, "all-gather"));
    }
  }
  for (int root : {0, n - 1}) {
    // Non-roots start with their own inputs, which the broadcast must overwrite.
    std::vector<char> buffer = Inputs(rank, count, dtype);
    TESSERA_RETURN_IF_ERROR(
        comm.Broadcast(buffer.data(), count, dtype, root).WithContext("broadcast"));
    TESSERA_RETURN_IF_ERROR(CheckCopied(buffer.data(), count, dtype, root, 0,
                                        fmt::format("broadcast from rank {}", root)));
  }
  for (size_t k = 0; k < std::size(kOps); ++k) {
    const ReduceOp op = kOps[k];
    if (!all_ops && op != ReduceOp::kSum) continue;
    const int root = static_cast<int>(k) % n;
    std::vector<char> send = Inputs(rank, count, dtype);
    std::vector<char> recv(static_cast<size_t>(count * element));
    TESSERA_RETURN_IF_ERROR(
        comm.Reduce(send.data(), recv.data(), count, dtype, op, root).WithContext("reduce"));
    if (rank == root) {
      TESSERA_RETURN_IF_ERROR(CheckReduced(recv.data(), count, dtype, op, n, 0,
                                           fmt::format("reduce to rank {}", root)));
    }
  }
  if (n > 1) {
    // A ring shift: every rank sends to its right and receives from its left at once.
    std::vector<char> send = Inputs(rank, count, dtype);
    std::vector<char> recv(static_cast<size_t>(count * element));
    const int left = (rank + n - 1) % n;
    TESSERA_RETURN_IF_ERROR(
        comm.SendRecv(send.data(), count, (rank + 1) % n, recv.data(), count, left, dtype)
            .WithContext("send-recv"));
    TESSERA_RETURN_IF_ERROR(CheckCopied(recv.data(), count, dtype, left, 0, "ring shift"));
  }
  if (n > 1) {
    // A chain: rank 0's inputs travel 0 -> 1 -> ... -> n-1 by send/recv.
    std::vector<char> buffer = Inputs(rank, count, dtype);
    if (rank > 0) {
      TESSERA_RETURN_IF_ERROR(comm.Recv(buffer.data(), count, dtype, rank - 1).WithContext("recv"));
      TESSERA_RETURN_IF_ERROR(CheckCopied(buffer.data(), count, dtype, 0, 0, "send/recv chain"));
    }
    if (rank < n - 1) {
      TESSERA_RETURN_IF_ERROR(comm.Send(buffer.data(), count, dtype, rank + 1).WithContext("send"));
    }
  }
  return Status::Ok();
}

}  // namespace

double CollectiveInput(int rank, int64_t index, DType dtype) {
  const uint32_t h = (static_cast<uint32_t>(index) * 2654435761u) ^
                     (static_cast<uint32_t>(rank + 1) * 40503u) ^
                     static_cast<uint32_t>(index >> 32);
  const uint32_t mixed = h ^ (h >> 15);
  if (dtype == DType::kI32) return static_cast<int>(mixed % 2001) - 1000;
  return (static_cast<int>(mixed % 201) - 100) / 8.0;
}

Status RunCollectiveSuite(Communicator& communicator, const CollectiveSuiteOptions& options) {
  for (DType dtype : options.dtypes) {
    for (int64_t size : options.sizes) {
      TESSERA_RETURN_IF_ERROR(RunOne(communicator, dtype, size, /*all_ops=*/true,
                                     /*everything=*/true));
    }
  }
  if (options.large_bytes > 0) {
    for (DType dtype : options.dtypes) {
      TESSERA_RETURN_IF_ERROR(RunOne(communicator, dtype, options.large_bytes / DTypeSize(dtype),
                                     /*all_ops=*/false, /*everything=*/dtype == DType::kF32));
    }
  }
  return Status::Ok();
}

Status CheckedAllReduce(Communicator& communicator, int64_t count) {
  std::vector<char> buffer = Inputs(communicator.rank(), count, DType::kF32);
  TESSERA_RETURN_IF_ERROR(
      communicator.AllReduce(buffer.data(), count, DType::kF32, ReduceOp::kSum));
  return CheckReduced(buffer.data(), count, DType::kF32, ReduceOp::kSum, communicator.size(), 0,
                      "all-reduce");
}

}  // namespace tessera::testing
