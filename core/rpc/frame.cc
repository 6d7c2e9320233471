#include "core/rpc/frame.h"

#include <algorithm>
#include <cstring>

#include <kj/io.h>

namespace tessera::rpc {

namespace {

uint32_t ReadU32(const uint8_t* p) {
  uint32_t value;
  std::memcpy(&value, p, sizeof(value));
  return value;
}

// Limits on what a peer can make us traverse. Cap'n Proto charges every pointer followed, so an
// honest reader that visits parts of a message more than once (e.g. a batch of tasks, each read
// a few times) needs a multiple of the frame's size; the cap stops messages built to make a
// reader walk the same data over and over (amplification). Nesting stays shallow.
capnp::ReaderOptions ReaderLimits(size_t words) {
  capnp::ReaderOptions options;
  options.traversalLimitInWords = std::max<uint64_t>(16 * words, uint64_t{8} << 20);
  options.nestingLimit = 32;
  return options;
}

}  // namespace

std::vector<uint8_t> EncodeFrame(capnp::MessageBuilder& message) {
  std::vector<uint8_t> frame;
  AppendFrame(message, frame);
  return frame;
}

void AppendFrame(capnp::MessageBuilder& message, std::vector<uint8_t>& frames) {
  // Serialised straight into the frame: one copy.
  const size_t payload_bytes = capnp::computeSerializedSizeInWords(message) * sizeof(capnp::word);
  const size_t start = frames.size();
  frames.resize(start + kFrameHeaderBytes + payload_bytes);
  uint8_t* frame = frames.data() + start;
  const uint32_t magic = kFrameMagic;
  const auto length = static_cast<uint32_t>(payload_bytes);
  std::memcpy(frame, &magic, 4);
  std::memcpy(frame + 4, &length, 4);
  kj::ArrayOutputStream payload(
      kj::arrayPtr(reinterpret_cast<kj::byte*>(frame + kFrameHeaderBytes), payload_bytes));
  capnp::writeMessage(payload, message);
}

namespace {
constexpr size_t kScratchWords = 1024;  // capnp's suggested first segment
constexpr size_t kScratchKept = 4;      // per thread: builders alive at once on one thread

struct ScratchPool {
  std::vector<capnp::word*> free;
  ~ScratchPool() {
    for (capnp::word* words : free) delete[] words;
  }
};
thread_local ScratchPool scratch_pool;
}  // namespace

ScratchSegment::ScratchSegment() {
  capnp::word* taken;
  if (scratch_pool.free.empty()) {
    taken = new capnp::word[kScratchWords]();  // zeroed, as capnp requires
  } else {
    taken = scratch_pool.free.back();
    scratch_pool.free.pop_back();
  }
  words = kj::arrayPtr(taken, kScratchWords);
}

ScratchSegment::~ScratchSegment() {
  // The builder's destructor, which ran first, zeroed what it used.
  if (scratch_pool.free.size() < kScratchKept) {
    scratch_pool.free.push_back(words.begin());
  } else {
    delete[] words.begin();
  }
}

ReceivedMessage::ReceivedMessage(kj::Array<capnp::word> words) : words_(kj::mv(words)) {
  reader_ =
      std::make_unique<capnp::FlatArrayMessageReader>(words_.asPtr(), ReaderLimits(words_.size()));
}

Status FrameDecoder::Feed(std::span<const uint8_t> bytes) {
  if (!error_.ok()) return error_;
  pending_.insert(pending_.end(), bytes.begin(), bytes.end());
  while (pending_.size() - consumed_ >= kFrameHeaderBytes) {
    const uint8_t* header = pending_.data() + consumed_;
    const uint32_t magic = ReadU32(header);
    const uint32_t length = ReadU32(header + 4);
    if (magic != kFrameMagic) {
      error_ = InvalidArgument("bad frame magic 0x{:08x} (not a Tessera peer?)", magic);
      return error_;
    }
    if (length > max_frame_bytes_ && !messages_.empty()) break;  // judged once those are handled
    if (length > max_frame_bytes_ || length % sizeof(capnp::word) != 0 || length == 0) {
      error_ = InvalidArgument("bad frame length {} (limit {}, must be a positive multiple of 8)",
                               length, max_frame_bytes_);
      return error_;
    }
    if (pending_.size() - consumed_ < kFrameHeaderBytes + length) break;
    auto words = kj::heapArray<capnp::word>(length / sizeof(capnp::word));
    std::memcpy(words.begin(), header + kFrameHeaderBytes, length);
    Status parsed = CatchMalformed([&]() -> Status {
      messages_.push_back(std::make_unique<ReceivedMessage>(kj::mv(words)));
      return Status::Ok();
    });
    if (!parsed.ok()) {
      error_ = parsed;
      return error_;
    }
    consumed_ += kFrameHeaderBytes + length;
  }
  // Compact once the consumed prefix dominates, so the buffer does not grow without bound.
  if (consumed_ > 0 && consumed_ * 2 >= pending_.size()) {
    pending_.erase(pending_.begin(), pending_.begin() + static_cast<ptrdiff_t>(consumed_));
    consumed_ = 0;
  }
  return Status::Ok();
}

std::unique_ptr<ReceivedMessage> FrameDecoder::PopMessage() {
  if (messages_.empty()) return nullptr;
  std::unique_ptr<ReceivedMessage> message = std::move(messages_.front());
  messages_.pop_front();
  return message;
}

}  // namespace tessera::rpc
