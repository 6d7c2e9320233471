// HostCommunicator: the collective algorithms, written over PeerTransport's Isend/Irecv/Wait.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "collectives/communicator.h"

namespace tessera {

namespace {

using RequestId = PeerTransport::RequestId;

// Tags fit PeerTransport's 48 bits. Bit 47 marks point-to-point messages (a per-peer counter
// below it); collectives use [call sequence: 23][step: 12][chunk: 12], so messages of different
// calls, steps or chunks never match each other. Sequences wrap after 8M calls, long after any
// message of the old call is gone.
constexpr uint64_t kPointToPointTag = uint64_t{1} << 47;
constexpr int64_t kMaxChunks = 4095;
constexpr int kMaxRanks = 2000;  // every step number (up to 2n) must fit 12 bits

uint64_t CollectiveTag(uint64_t sequence, int step, int64_t chunk) {
  return ((sequence & ((uint64_t{1} << 23) - 1)) << 24) | (static_cast<uint64_t>(step) << 12) |
         static_cast<uint64_t>(chunk);
}

int Mod(int a, int n) { return ((a % n) + n) % n; }

// Whether two buffers of `bytes` each share a byte (compared as addresses: they may be unrelated
// allocations).
bool BuffersOverlap(const void* a, const void* b, int64_t bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a);
  const auto y = reinterpret_cast<uintptr_t>(b);
  const auto length = static_cast<uintptr_t>(bytes);
  return x < y + length && y < x + length;
}

// A buffer of `count` elements (of `element` bytes) as the ring sees it: n nearly equal
// segments (the first count % n are one element longer), each moved in chunks of at most
// `chunk` elements.
struct RingLayout {
  int64_t count;
  int n;
  int64_t element;
  int64_t chunk;

  int64_t begin(int s) const { return s * (count / n) + std::min<int64_t>(s, count % n); }
  int64_t length(int s) const { return count / n + (s < count % n ? 1 : 0); }
  int64_t segment_bytes(int s) const { return length(s) * element; }
  int64_t max_segment_bytes() const { return segment_bytes(0); }
  int64_t chunks(int s) const { return (length(s) + chunk - 1) / chunk; }
  int64_t chunk_length(int s, int64_t c) const { return std::min(chunk, length(s) - c * chunk); }
  int64_t chunk_bytes(int s, int64_t c) const { return chunk_length(s, c) * element; }
  // Byte offsets of chunk c: within its segment, and of segment s's chunk c in the buffer.
  int64_t within(int64_t c) const { return c * chunk * element; }
  int64_t offset(int s, int64_t c) const { return begin(s) * element + within(c); }
};

class HostCommunicator final : public Communicator {
 public:
  HostCommunicator(PeerTransport& transport, const CommunicatorOptions& options,
                   std::shared_ptr<PeerTransport> owned = nullptr)
      : owned_(std::move(owned)),
        transport_(transport),
        options_(options),
        rank_(transport.rank()),
        size_(transport.size()),
        left_(Mod(rank_ - 1, size_)),
        right_(Mod(rank_ + 1, size_)),
        sends_to_(static_cast<size_t>(size_), 0),
        receives_from_(static_cast<size_t>(size_), 0) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int64_t bytes_sent() const override { return bytes_sent_; }
  void Abort(const Status& reason) override { transport_.Abort(reason); }

  Status AllReduce(void* buffer, int64_t count, DType dtype, ReduceOp op) override {
    TESSERA_ASSIGN_OR_RETURN(const Call call, Begin(count, dtype, "all-reduce", Kind::kReduction));
    char* data = static_cast<char*>(buffer);
    if (size_ > 1 && count > 0) {
      if (count * DTypeSize(dtype) <= options_.small_bytes || count < size_) {
        TESSERA_RETURN_IF_ERROR(DirectAllReduce(call, data, count, dtype, op));
      } else {
        // Reduce-scatter then all-gather: the ring's 2(n-1) steps in one pipeline.
        TESSERA_RETURN_IF_ERROR(
            Ring(call, data, Layout(count, dtype), dtype, op, 0, 2 * (size_ - 1)));
      }
    }
    return Finish(buffer, count, dtype, op, size_);
  }

  Status ReduceScatter(const void* send, void* recv, int64_t count, DType dtype,
                       ReduceOp op) override {
    TESSERA_ASSIGN_OR_RETURN(const Call call,
                             Begin(count, dtype, "reduce-scatter", Kind::kReduction));
    if (count == 0) return Status::Ok();
    if (size_ == 1) {
      std::memmove(recv, send, static_cast<size_t>(count * DTypeSize(dtype)));
    } else if (count * size_ * DTypeSize(dtype) <= options_.small_bytes) {
      TESSERA_RETURN_IF_ERROR(DirectReduceScatter(call, static_cast<const char*>(send),
                                                  static_cast<char*>(recv), count, dtype, op));
    } else {
      TESSERA_RETURN_IF_ERROR(RingReduceScatter(call, static_cast<const char*>(send),
                                                static_cast<char*>(recv),
                                                Layout(count * size_, dtype), dtype, op));
    }
    return Finish(recv, count, dtype, op, size_);
  }

  Status AllGather(const void* send, void* recv, int64_t count, DType dtype) override {
    TESSERA_ASSIGN_OR_RETURN(const Call call, Begin(count, dtype, "all-gather", Kind::kCopy));
    const int64_t element = DTypeSize(dtype);
    char* out = static_cast<char*>(recv);
    if (count == 0) return Status::Ok();
    // memmove: an in-place all-gather passes its own block as `send`.
    std::memmove(out + rank_ * count * element, send, static_cast<size_t>(count * element));
    if (size_ == 1) return Status::Ok();
    // The all-gather half of the ring: rank r starts with block r.
    return Ring(call, out, Layout(count * size_, dtype), dtype, ReduceOp::kSum, size_ - 1,
                2 * (size_ - 1));
  }

  // Pairwise exchange: at step k (1 .. n-1) this rank sends its block for rank+k and receives
  // rank-k's block for it, so each step every rank has exactly one sender and one receiver.
  Status AllToAll(const void* send, void* recv, int64_t count, DType dtype) override {
    TESSERA_ASSIGN_OR_RETURN(const Call call, Begin(count, dtype, "all-to-all", Kind::kCopy));
    if (count == 0) return Status::Ok();
    const int64_t block = count * DTypeSize(dtype);
    const char* input = static_cast<const char*>(send);
    char* output = static_cast<char*>(recv);
    if (BuffersOverlap(send, recv, block * size_)) {
      return InvalidArgument(
          "all-to-all of {} x {} per rank: the send and receive buffers overlap (pass separate "
          "buffers of {} bytes each)",
          count, DTypeName(dtype), block * size_);
    }
    std::memcpy(output + rank_ * block, input + rank_ * block, static_cast<size_t>(block));
    for (int step = 1; step < size_; ++step) {
      const int dest = Mod(rank_ + step, size_);
      const int source = Mod(rank_ - step, size_);
      const uint64_t tag = CollectiveTag(call.sequence, step, 0);
      TESSERA_ASSIGN_OR_RETURN(auto receive,
                               transport_.Irecv(source, tag, output + source * block, block));
      TESSERA_ASSIGN_OR_RETURN(auto sent, SendTo(dest, tag, input + dest * block, block));
      TESSERA_RETURN_IF_ERROR(WaitFor({receive}, call, source));
      TESSERA_RETURN_IF_ERROR(WaitFor({sent}, call, dest));
    }
    return Status::Ok();
  }

  Status Broadcast(void* buffer, int64_t count, DType dtype, int root) override {
    TESSERA_ASSIGN_OR_RETURN(const Call call, Begin(count, dtype, "broadcast", Kind::kCopy));
    TESSERA_RETURN_IF_ERROR(CheckPeer(root, "root"));
    if (size_ == 1 || count == 0) return Status::Ok();
    char* data = static_cast<char*>(buffer);
    const int64_t bytes = count * DTypeSize(dtype);
    if (bytes <= options_.small_bytes) {
      std::vector<RequestId> requests;
      if (rank_ == root) {
        for (int peer = 0; peer < size_; ++peer) {
          if (peer == root) continue;
          TESSERA_ASSIGN_OR_RETURN(auto id,
                                   SendTo(peer, CollectiveTag(call.sequence, 0, 0), data, bytes));
          requests.push_back(id);
        }
        return WaitFor(requests, call, -1);
      }
      TESSERA_ASSIGN_OR_RETURN(
          auto id, transport_.Irecv(root, CollectiveTag(call.sequence, 0, 0), data, bytes));
      return WaitFor({id}, call, root);
    }
    return ChainBroadcast(call, data, bytes, root);
  }

  Status Reduce(const void* send, void* recv, int64_t count, DType dtype, ReduceOp op,
                int root) override {
    TESSERA_ASSIGN_OR_RETURN(const Call call, Begin(count, dtype, "reduce", Kind::kReduction));
    TESSERA_RETURN_IF_ERROR(CheckPeer(root, "root"));
    if (count == 0) return Status::Ok();
    const int64_t element = DTypeSize(dtype);
    const int64_t bytes = count * element;
    const char* input = static_cast<const char*>(send);
    if (size_ == 1) {
      std::memmove(recv, send, static_cast<size_t>(bytes));
      return Finish(recv, count, dtype, op, size_);
    }
    if (bytes <= options_.small_bytes || count < size_) {
      return DirectReduce(call, input, static_cast<char*>(recv), count, dtype, op, root);
    }
    // Ring reduce-scatter, then every rank sends its reduced segment to the root: the root
    // receives (n-1)/n of the buffer instead of (n-1) buffers.
    const RingLayout layout = Layout(count, dtype);
    std::vector<char> mine(static_cast<size_t>(layout.segment_bytes(rank_)));
    TESSERA_RETURN_IF_ERROR(RingReduceScatter(call, input, mine.data(), layout, dtype, op));
    const uint64_t tag = CollectiveTag(call.sequence, 2 * size_, 0);
    if (rank_ != root) {
      TESSERA_ASSIGN_OR_RETURN(auto id,
                               SendTo(root, tag, mine.data(), layout.segment_bytes(rank_)));
      return WaitFor({id}, call, root);
    }
    char* out = static_cast<char*>(recv);
    std::vector<RequestId> requests;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == root) continue;
      TESSERA_ASSIGN_OR_RETURN(auto id, transport_.Irecv(peer, tag, out + layout.offset(peer, 0),
                                                         layout.segment_bytes(peer)));
      requests.push_back(id);
    }
    std::memcpy(out + layout.offset(rank_, 0), mine.data(),
                static_cast<size_t>(layout.segment_bytes(rank_)));
    TESSERA_RETURN_IF_ERROR(WaitFor(requests, call, -1));
    return Finish(recv, count, dtype, op, size_);
  }

  Status Send(const void* data, int64_t count, DType dtype, int peer) override {
    TESSERA_RETURN_IF_ERROR(CheckPeer(peer, "peer"));
    return SendRecv(data, count, peer, nullptr, 0, -1, dtype);
  }

  Status Recv(void* data, int64_t count, DType dtype, int peer) override {
    TESSERA_RETURN_IF_ERROR(CheckPeer(peer, "peer"));
    return SendRecv(nullptr, 0, -1, data, count, peer, dtype);
  }

  Status SendRecv(const void* send, int64_t send_count, int dest, void* recv, int64_t recv_count,
                  int source, DType dtype) override {
    // Point-to-point calls take no collective number (only some ranks make them); a per-peer
    // counter keeps successive messages between a pair apart.
    TESSERA_ASSIGN_OR_RETURN(const Call call, Begin(std::min(send_count, recv_count), dtype,
                                                    "send/recv", Kind::kPointToPoint));
    std::vector<RequestId> requests;
    const int64_t element = DTypeSize(dtype);
    if (source == rank_ || dest == rank_) {
      return InvalidArgument("rank {} cannot send to or receive from itself", rank_);
    }
    if (source >= 0) {
      TESSERA_RETURN_IF_ERROR(CheckPeer(source, "source"));
      const uint64_t tag =
          kPointToPointTag | (receives_from_[static_cast<size_t>(source)]++ % kPointToPointTag);
      TESSERA_ASSIGN_OR_RETURN(auto id, transport_.Irecv(source, tag, recv, recv_count * element));
      requests.push_back(id);
    }
    if (dest >= 0) {
      TESSERA_RETURN_IF_ERROR(CheckPeer(dest, "destination"));
      const uint64_t tag =
          kPointToPointTag | (sends_to_[static_cast<size_t>(dest)]++ % kPointToPointTag);
      TESSERA_ASSIGN_OR_RETURN(auto id, SendTo(dest, tag, send, send_count * element));
      requests.push_back(id);
    }
    return WaitFor(requests, call, source >= 0 ? source : dest);
  }

 private:
  struct Call {
    uint64_t sequence;
    PeerTransport::Clock::time_point deadline;
  };

  // What a call does with the bytes: reduces them (f32, bf16, f16, i32 only), copies them
  // between all ranks (any dtype), or moves them between two ranks (any dtype, no number).
  enum class Kind { kReduction, kCopy, kPointToPoint };

  // Validates the arguments and numbers a collective call (every rank numbers its collectives
  // alike; point-to-point calls, made by some ranks only, take no number).
  Result<Call> Begin(int64_t count, DType dtype, const char* what, Kind kind) {
    if (size_ > kMaxRanks) {
      return InvalidArgument("{} over {} ranks (at most {})", what, size_, kMaxRanks);
    }
    if (count < 0) return InvalidArgument("{} of {} elements", what, count);
    if (kind == Kind::kReduction && !CollectiveSupports(dtype)) {
      return InvalidArgument("{} does not reduce {} (f32, bf16, f16, i32 only)", what,
                             DTypeName(dtype));
    }
    return Call{kind == Kind::kPointToPoint ? 0 : next_sequence_++,
                PeerTransport::Clock::now() + std::chrono::milliseconds(options_.timeout_ms)};
  }

  Status CheckPeer(int peer, const char* what) const {
    if (peer < 0 || peer >= size_) {
      return InvalidArgument("{} {} is not a rank of this {}-rank group", what, peer, size_);
    }
    return Status::Ok();
  }

  Result<RequestId> SendTo(int peer, uint64_t tag, const void* data, int64_t bytes) {
    bytes_sent_ += bytes;
    return transport_.Isend(peer, tag, data, bytes);
  }

  // Waits, adding who was waiting on whom (`peer`, or -1 for several) to an error.
  Status WaitFor(const std::vector<RequestId>& requests, const Call& call, int peer) {
    Status status = transport_.Wait(requests, call.deadline);
    if (status.ok()) return status;
    if (!reported_failure_ && options_.on_failure) {
      reported_failure_ = true;
      status = options_.on_failure(status);
    }
    return status.WithContext(peer >= 0 ? fmt::format("rank {} (waiting on rank {})", rank_, peer)
                                        : fmt::format("rank {}", rank_));
  }

  // Elements per chunk for segments of up to `length` elements: chunk_bytes, or larger when a
  // segment would need more chunks than a tag can number.
  int64_t ChunkElements(int64_t length, int64_t element) const {
    const int64_t by_size = std::max<int64_t>(1, options_.chunk_bytes / element);
    return std::max(by_size, (length + kMaxChunks - 1) / kMaxChunks);
  }

  RingLayout Layout(int64_t count, DType dtype) const {
    RingLayout layout{count, size_, DTypeSize(dtype), 1};
    layout.chunk = ChunkElements(layout.length(0), layout.element);
    return layout;
  }

  // The ring. Over steps t = 0 .. 2(n-1)-1 rank r sends segment (r-t-1) mod n to its right
  // neighbour and receives segment (r-t-2) mod n from its left one. In the first n-1 steps
  // (reduce-scatter) a received segment is reduced into the local copy; afterwards (all-gather)
  // it is stored. What arrives at step t is what leaves at step t+1, so each chunk is forwarded
  // as soon as it has been reduced or stored: every link stays busy (pipelining). After step
  // n-2 rank r holds segment r fully reduced; after step 2n-3 every rank holds every segment.
  // Runs steps [first, last): reduce-scatter alone is [0, n-1), all-gather alone [n-1, 2n-2).
  Status Ring(const Call& call, char* data, const RingLayout& layout, DType dtype, ReduceOp op,
              int first, int last) {
    std::vector<RequestId> sends;
    const int first_segment = Mod(rank_ - first - 1, size_);
    for (int64_t c = 0; c < layout.chunks(first_segment); ++c) {
      TESSERA_ASSIGN_OR_RETURN(auto id, SendTo(right_, CollectiveTag(call.sequence, first, c),
                                               data + layout.offset(first_segment, c),
                                               layout.chunk_bytes(first_segment, c)));
      sends.push_back(id);
    }
    char* scratch = first < size_ - 1 ? Scratch(0, layout.max_segment_bytes()) : nullptr;
    for (int step = first; step < last; ++step) {
      const int segment = Mod(rank_ - step - 2, size_);
      const bool reducing = step < size_ - 1;
      std::vector<RequestId> receives;
      for (int64_t c = 0; c < layout.chunks(segment); ++c) {
        char* into = reducing ? scratch + layout.within(c) : data + layout.offset(segment, c);
        TESSERA_ASSIGN_OR_RETURN(
            auto id, transport_.Irecv(left_, CollectiveTag(call.sequence, step, c), into,
                                      layout.chunk_bytes(segment, c)));
        receives.push_back(id);
      }
      for (int64_t c = 0; c < layout.chunks(segment); ++c) {
        TESSERA_RETURN_IF_ERROR(WaitFor({receives[static_cast<size_t>(c)]}, call, left_));
        char* chunk = data + layout.offset(segment, c);
        if (reducing) {
          TESSERA_RETURN_IF_ERROR(Accumulate(chunk, scratch + layout.within(c),
                                             layout.chunk_length(segment, c), dtype, op));
        }
        if (step + 1 < last) {
          TESSERA_ASSIGN_OR_RETURN(auto id,
                                   SendTo(right_, CollectiveTag(call.sequence, step + 1, c), chunk,
                                          layout.chunk_bytes(segment, c)));
          sends.push_back(id);
        }
      }
    }
    return WaitFor(sends, call, right_);
  }

  // Reduce-scatter from a read-only input: the ring's first n-1 steps, except that a received
  // partial is combined with this rank's own segment in a work buffer (two alternate: one is
  // forwarded while the next fills), and the last step, segment rank(), lands in `output`.
  Status RingReduceScatter(const Call& call, const char* input, char* output,
                           const RingLayout& layout, DType dtype, ReduceOp op) {
    char* work[2] = {Scratch(0, layout.max_segment_bytes()),
                     Scratch(1, layout.max_segment_bytes())};
    // sends[t]: the chunks forwarded from what arrived at step t-1 (tagged step t).
    std::vector<std::vector<RequestId>> sends(static_cast<size_t>(size_));
    const int first_segment = Mod(rank_ - 1, size_);
    for (int64_t c = 0; c < layout.chunks(first_segment); ++c) {
      TESSERA_ASSIGN_OR_RETURN(auto id, SendTo(right_, CollectiveTag(call.sequence, 0, c),
                                               input + layout.offset(first_segment, c),
                                               layout.chunk_bytes(first_segment, c)));
      sends[0].push_back(id);
    }
    for (int step = 0; step < size_ - 1; ++step) {
      const int segment = Mod(rank_ - step - 2, size_);
      const bool last = step == size_ - 2;  // segment == rank_
      char* into = last ? output : work[step % 2];
      // work[step % 2] was forwarded at step - 1 (tagged step - 1): those sends must be done.
      if (step >= 2) {
        TESSERA_RETURN_IF_ERROR(WaitFor(sends[static_cast<size_t>(step - 1)], call, right_));
      }
      std::vector<RequestId> receives;
      for (int64_t c = 0; c < layout.chunks(segment); ++c) {
        TESSERA_ASSIGN_OR_RETURN(
            auto id, transport_.Irecv(left_, CollectiveTag(call.sequence, step, c),
                                      into + layout.within(c), layout.chunk_bytes(segment, c)));
        receives.push_back(id);
      }
      for (int64_t c = 0; c < layout.chunks(segment); ++c) {
        TESSERA_RETURN_IF_ERROR(WaitFor({receives[static_cast<size_t>(c)]}, call, left_));
        char* partial = into + layout.within(c);
        TESSERA_RETURN_IF_ERROR(Accumulate(partial, input + layout.offset(segment, c),
                                           layout.chunk_length(segment, c), dtype, op));
        if (!last) {
          TESSERA_ASSIGN_OR_RETURN(
              auto id, SendTo(right_, CollectiveTag(call.sequence, step + 1, c), partial,
                              layout.chunk_bytes(segment, c)));
          sends[static_cast<size_t>(step) + 1].push_back(id);
        }
      }
    }
    std::vector<RequestId> outstanding;
    for (const auto& step_sends : sends) {
      outstanding.insert(outstanding.end(), step_sends.begin(), step_sends.end());
    }
    return WaitFor(outstanding, call, right_);
  }

  // Scratch buffer `which` of at least `bytes`, kept between calls (no page faults per call).
  char* Scratch(int which, int64_t bytes) {
    std::vector<char>& buffer = scratch_[which];
    if (static_cast<int64_t>(buffer.size()) < bytes) buffer.resize(static_cast<size_t>(bytes));
    return buffer.data();
  }

  // Small all-reduce: every rank sends its buffer to every other and combines all of them in
  // rank order, so every rank computes bitwise the same result. One latency, (n-1) copies.
  // One hop of a direct collective: every peer is sent its part (`part_for(peer)`, `bytes`
  // long) and every peer's part for this rank received; returns the parts in rank order, this
  // rank's own (part_for(rank_)) among them.
  template <typename PartFor>
  Result<std::vector<std::vector<char>>> ExchangeParts(const Call& call, int64_t bytes,
                                                       PartFor&& part_for) {
    const uint64_t tag = CollectiveTag(call.sequence, 0, 0);
    std::vector<std::vector<char>> parts(static_cast<size_t>(size_));
    std::vector<RequestId> requests;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      parts[static_cast<size_t>(peer)].resize(static_cast<size_t>(bytes));
      TESSERA_ASSIGN_OR_RETURN(
          auto receive,
          transport_.Irecv(peer, tag, parts[static_cast<size_t>(peer)].data(), bytes));
      TESSERA_ASSIGN_OR_RETURN(auto send, SendTo(peer, tag, part_for(peer), bytes));
      requests.push_back(receive);
      requests.push_back(send);
    }
    TESSERA_RETURN_IF_ERROR(WaitFor(requests, call, -1));
    const char* own = part_for(rank_);
    parts[static_cast<size_t>(rank_)].assign(own, own + bytes);
    return parts;
  }

  Status DirectAllReduce(const Call& call, char* data, int64_t count, DType dtype, ReduceOp op) {
    TESSERA_ASSIGN_OR_RETURN(
        auto parts, ExchangeParts(call, count * DTypeSize(dtype), [data](int) { return data; }));
    return CombineInRankOrder(parts, data, count, dtype, op);
  }

  // Small reduce-scatter: every rank sends each other rank its block of `count` elements and
  // combines the blocks it receives for its own in rank order (the bytes of the ring, one hop).
  Status DirectReduceScatter(const Call& call, const char* send, char* recv, int64_t count,
                             DType dtype, ReduceOp op) {
    const int64_t bytes = count * DTypeSize(dtype);
    TESSERA_ASSIGN_OR_RETURN(auto parts, ExchangeParts(call, bytes, [send, bytes](int peer) {
                               return send + peer * bytes;
                             }));
    return CombineInRankOrder(parts, recv, count, dtype, op);
  }

  // Small reduce: every rank sends to the root, which combines in rank order.
  Status DirectReduce(const Call& call, const char* send, char* recv, int64_t count, DType dtype,
                      ReduceOp op, int root) {
    const int64_t bytes = count * DTypeSize(dtype);
    const uint64_t tag = CollectiveTag(call.sequence, 0, 0);
    if (rank_ != root) {
      TESSERA_ASSIGN_OR_RETURN(auto id, SendTo(root, tag, send, bytes));
      return WaitFor({id}, call, root);
    }
    std::vector<std::vector<char>> parts(static_cast<size_t>(size_));
    std::vector<RequestId> requests;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == root) continue;
      parts[static_cast<size_t>(peer)].resize(static_cast<size_t>(bytes));
      TESSERA_ASSIGN_OR_RETURN(
          auto id, transport_.Irecv(peer, tag, parts[static_cast<size_t>(peer)].data(), bytes));
      requests.push_back(id);
    }
    TESSERA_RETURN_IF_ERROR(WaitFor(requests, call, -1));
    parts[static_cast<size_t>(root)].assign(send, send + bytes);
    TESSERA_RETURN_IF_ERROR(CombineInRankOrder(parts, recv, count, dtype, op));
    return Finish(recv, count, dtype, op, size_);
  }

  static Status CombineInRankOrder(const std::vector<std::vector<char>>& parts, char* out,
                                   int64_t count, DType dtype, ReduceOp op) {
    std::memcpy(out, parts[0].data(), parts[0].size());
    for (size_t r = 1; r < parts.size(); ++r) {
      TESSERA_RETURN_IF_ERROR(Accumulate(out, parts[r].data(), count, dtype, op));
    }
    return Status::Ok();
  }

  // Large broadcast: a chain root -> root+1 -> ... in chunks; each rank forwards a chunk as soon
  // as it has it, so the time is about one buffer's transfer plus (n-2) chunks.
  Status ChainBroadcast(const Call& call, char* data, int64_t bytes, int root) {
    const int position = Mod(rank_ - root, size_);
    const int64_t chunk = ChunkElements(bytes, 1);
    const int64_t chunks = (bytes + chunk - 1) / chunk;
    auto length = [&](int64_t c) { return std::min(chunk, bytes - c * chunk); };
    std::vector<RequestId> receives, sends;
    if (position > 0) {
      for (int64_t c = 0; c < chunks; ++c) {
        TESSERA_ASSIGN_OR_RETURN(
            auto id, transport_.Irecv(left_, CollectiveTag(call.sequence, 0, c), data + c * chunk,
                                      length(c)));
        receives.push_back(id);
      }
    }
    for (int64_t c = 0; c < chunks; ++c) {
      if (position > 0) {
        TESSERA_RETURN_IF_ERROR(WaitFor({receives[static_cast<size_t>(c)]}, call, left_));
      }
      if (position < size_ - 1) {
        TESSERA_ASSIGN_OR_RETURN(auto id, SendTo(right_, CollectiveTag(call.sequence, 0, c),
                                                 data + c * chunk, length(c)));
        sends.push_back(id);
      }
    }
    return WaitFor(sends, call, right_);
  }

  const std::shared_ptr<PeerTransport> owned_;  // when the communicator owns its transport
  PeerTransport& transport_;
  const CommunicatorOptions options_;
  const int rank_;
  const int size_;
  const int left_;
  const int right_;
  uint64_t next_sequence_ = 1;
  std::vector<uint64_t> sends_to_;
  std::vector<uint64_t> receives_from_;
  int64_t bytes_sent_ = 0;
  bool reported_failure_ = false;
  std::vector<char> scratch_[2];
};

}  // namespace

std::unique_ptr<Communicator> MakeHostCommunicator(PeerTransport& transport,
                                                   const CommunicatorOptions& options) {
  return std::make_unique<HostCommunicator>(transport, options);
}

std::unique_ptr<Communicator> MakeHostCommunicator(std::shared_ptr<PeerTransport> transport,
                                                   const CommunicatorOptions& options) {
  PeerTransport& reference = *transport;
  return std::make_unique<HostCommunicator>(reference, options, std::move(transport));
}

}  // namespace tessera
