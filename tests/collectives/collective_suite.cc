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

// The two buffers every collective of a suite uses, kept between collectives: at the large
// sizes a fresh buffer per collective cost more (zeroing and page faults) than the collective.
struct Buffers {
  std::vector<char> send, recv;
};

// `buffer` grown to `count` elements holding rank `rank`'s inputs from element 0 on.
char* Inputs(std::vector<char>& buffer, int rank, int64_t count, DType dtype) {
  const auto bytes = static_cast<size_t>(count * DTypeSize(dtype));
  if (buffer.size() < bytes) buffer.resize(bytes);
  for (int64_t i = 0; i < count; ++i) {
    Store(buffer.data(), i, dtype, CollectiveInput(rank, i, dtype));
  }
  return buffer.data();
}

// `buffer` grown to `bytes` and filled with 0x7F bytes, a value no input or result takes in any
// dtype, so an element a collective never wrote is caught (and not left from the one before).
char* Poisoned(std::vector<char>& buffer, int64_t bytes) {
  if (buffer.size() < static_cast<size_t>(bytes)) buffer.resize(static_cast<size_t>(bytes));
  // An empty vector's data() may be null, which memset must not get even for 0 bytes.
  if (bytes > 0) std::memset(buffer.data(), 0x7F, static_cast<size_t>(bytes));
  return buffer.data();
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
// poisoned (Poisoned), so a block never written is caught.
Status CheckAllToAll(Communicator& comm, Buffers& buffers, DType dtype, int64_t block) {
  const int rank = comm.rank(), n = comm.size();
  const int64_t element = DTypeSize(dtype);
  const char* send = Inputs(buffers.send, rank, block * n, dtype);
  char* recv = Poisoned(buffers.recv, block * n * element);
  TESSERA_RETURN_IF_ERROR(comm.AllToAll(send, recv, block, dtype).WithContext("all-to-all"));
  for (int source = 0; source < n; ++source) {
    TESSERA_RETURN_IF_ERROR(CheckCopied(recv + source * block * element, block, dtype, source,
                                        rank * block,
                                        fmt::format("all-to-all block from rank {}", source)));
  }
  return Status::Ok();
}

Status RunOne(Communicator& comm, Buffers& buffers, DType dtype, int64_t count, bool all_ops,
              bool everything) {
  const int rank = comm.rank(), n = comm.size();
  const int64_t element = DTypeSize(dtype);
  for (ReduceOp op : kOps) {
    if (!all_ops && op != ReduceOp::kSum) continue;
    char* buffer = Inputs(buffers.send, rank, count, dtype);
    const std::string what = fmt::format("all-reduce {}", ReduceOpName(op));
    TESSERA_RETURN_IF_ERROR(comm.AllReduce(buffer, count, dtype, op).WithContext(what));
    TESSERA_RETURN_IF_ERROR(CheckReduced(buffer, count, dtype, op, n, 0, "all-reduce"));
  }
  // Reduce-scatter, all-gather and all-to-all take `count` as the whole buffer when it is large.
  const int64_t block = all_ops ? count : count / n;
  // All-to-all copies: cheap enough to run on every dtype at the large size too.
  TESSERA_RETURN_IF_ERROR(CheckAllToAll(comm, buffers, dtype, block));
  if (!everything) return Status::Ok();
  for (ReduceOp op : kOps) {
    if (!all_ops && op != ReduceOp::kSum) continue;
    const char* send = Inputs(buffers.send, rank, block * n, dtype);
    char* recv = Poisoned(buffers.recv, block * element);
    TESSERA_RETURN_IF_ERROR(
        comm.ReduceScatter(send, recv, block, dtype, op).WithContext("reduce-scatter"));
    TESSERA_RETURN_IF_ERROR(
        CheckReduced(recv, block, dtype, op, n, rank * block, "reduce-scatter"));
  }
  {
    const char* send = Inputs(buffers.send, rank, block, dtype);
    char* recv = Poisoned(buffers.recv, block * n * element);
    TESSERA_RETURN_IF_ERROR(comm.AllGather(send, recv, block, dtype).WithContext("all-gather"));
    for (int r = 0; r < n; ++r) {
      TESSERA_RETURN_IF_ERROR(
          CheckCopied(recv + r * block * element, block, dtype, r, 0, "all-gather"));
    }
  }
  for (int root : {0, n - 1}) {
    // Non-roots start with their own inputs, which the broadcast must overwrite.
    char* buffer = Inputs(buffers.send, rank, count, dtype);
    TESSERA_RETURN_IF_ERROR(comm.Broadcast(buffer, count, dtype, root).WithContext("broadcast"));
    TESSERA_RETURN_IF_ERROR(
        CheckCopied(buffer, count, dtype, root, 0, fmt::format("broadcast from rank {}", root)));
  }
  for (size_t k = 0; k < std::size(kOps); ++k) {
    const ReduceOp op = kOps[k];
    if (!all_ops && op != ReduceOp::kSum) continue;
    const int root = static_cast<int>(k) % n;
    const char* send = Inputs(buffers.send, rank, count, dtype);
    char* recv = Poisoned(buffers.recv, count * element);
    TESSERA_RETURN_IF_ERROR(comm.Reduce(send, recv, count, dtype, op, root).WithContext("reduce"));
    if (rank == root) {
      TESSERA_RETURN_IF_ERROR(
          CheckReduced(recv, count, dtype, op, n, 0, fmt::format("reduce to rank {}", root)));
    }
  }
  if (n > 1) {
    // A ring shift: every rank sends to its right and receives from its left at once.
    const char* send = Inputs(buffers.send, rank, count, dtype);
    char* recv = Poisoned(buffers.recv, count * element);
    const int left = (rank + n - 1) % n;
    TESSERA_RETURN_IF_ERROR(comm.SendRecv(send, count, (rank + 1) % n, recv, count, left, dtype)
                                .WithContext("send-recv"));
    TESSERA_RETURN_IF_ERROR(CheckCopied(recv, count, dtype, left, 0, "ring shift"));
  }
  if (n > 1) {
    // A chain: rank 0's inputs travel 0 -> 1 -> ... -> n-1 by send/recv; the others receive
    // into a poisoned buffer.
    char* buffer = rank == 0 ? Inputs(buffers.send, rank, count, dtype)
                             : Poisoned(buffers.send, count * element);
    if (rank > 0) {
      TESSERA_RETURN_IF_ERROR(comm.Recv(buffer, count, dtype, rank - 1).WithContext("recv"));
      TESSERA_RETURN_IF_ERROR(CheckCopied(buffer, count, dtype, 0, 0, "send/recv chain"));
    }
    if (rank < n - 1) {
      TESSERA_RETURN_IF_ERROR(comm.Send(buffer, count, dtype, rank + 1).WithContext("send"));
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
  Buffers buffers;
  for (DType dtype : options.dtypes) {
    for (int64_t size : options.sizes) {
      TESSERA_RETURN_IF_ERROR(RunOne(communicator, buffers, dtype, size, /*all_ops=*/true,
                                     /*everything=*/true));
    }
  }
  if (options.large_bytes > 0) {
    for (DType dtype : options.dtypes) {
      TESSERA_RETURN_IF_ERROR(RunOne(communicator, buffers, dtype,
                                     options.large_bytes / DTypeSize(dtype),
                                     /*all_ops=*/false, /*everything=*/dtype == DType::kF32));
    }
  }
  return Status::Ok();
}

Status CheckedAllReduce(Communicator& communicator, int64_t count) {
  std::vector<char> storage;
  char* buffer = Inputs(storage, communicator.rank(), count, DType::kF32);
  TESSERA_RETURN_IF_ERROR(communicator.AllReduce(buffer, count, DType::kF32, ReduceOp::kSum));
  return CheckReduced(buffer, count, DType::kF32, ReduceOp::kSum, communicator.size(), 0,
                      "all-reduce");
}

}  // namespace tessera::testing
