// Framing of Cap'n Proto messages on a byte stream.
//
// A frame is [u32 magic "TSR1"][u32 payload length][payload], little-endian, where the payload
// is a Cap'n Proto message in flat-array form (a multiple of 8 bytes). FrameDecoder accepts bytes
// in arbitrary pieces and yields whole messages. Anything malformed (wrong magic, a length that
// is too large or not word-aligned, a payload Cap'n Proto rejects) is an InvalidArgument or
// DataLoss error, never a crash: a peer that sends garbage loses its connection, nothing else.
//
// Not thread-safe: one decoder per connection, used by its io thread.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <vector>

#include <capnp/message.h>
#include <capnp/serialize.h>

#include "core/status.h"

namespace tessera::rpc {

inline constexpr uint32_t kFrameMagic = 0x31525354;  // "TSR1"
inline constexpr size_t kFrameHeaderBytes = 8;
// Control messages carry metadata and small inline objects; bulk data uses the data plane.
inline constexpr uint32_t kDefaultMaxFrameBytes = 256u << 20;

// Serialises a message into one frame.
std::vector<uint8_t> EncodeFrame(capnp::MessageBuilder& message);
// Serialises a message as one frame at the end of `frames` (several frames back to back, sent
// in one write).
void AppendFrame(capnp::MessageBuilder& message, std::vector<uint8_t>& frames);

// The first segment of a ScopedMessageBuilder: 8 KiB of zeroed words from this thread's pool
// (a few kept per thread), given back when the builder is gone.
struct ScratchSegment {
  ScratchSegment();
  ~ScratchSegment();
  ScratchSegment(const ScratchSegment&) = delete;
  ScratchSegment& operator=(const ScratchSegment&) = delete;
  kj::ArrayPtr<capnp::word> words;
};

// A builder for a message that is built, sent (encoded into a frame) and dropped by one thread:
// its first segment is scratch space the thread reuses, zeroed again by the builder's
// destructor over what was used. A control message that fits costs no allocation and no zeroing
// of a fresh 8 KiB (capnp::MallocMessageBuilder callocs its first segment: in a hot loop of
// small messages the scheduler spent its time in malloc). A message kept for later (a worker's
// last RunGraph) stays a capnp::MallocMessageBuilder.
class ScopedMessageBuilder : private ScratchSegment, public capnp::MallocMessageBuilder {
 public:
  ScopedMessageBuilder() : capnp::MallocMessageBuilder(ScratchSegment::words) {}
};

// A received message: owns its words; read it through reader().
class ReceivedMessage {
 public:
  explicit ReceivedMessage(kj::Array<capnp::word> words);
  capnp::MessageReader& reader() { return *reader_; }
  size_t bytes() const { return words_.size() * sizeof(capnp::word); }

 private:
  kj::Array<capnp::word> words_;
  std::unique_ptr<capnp::FlatArrayMessageReader> reader_;
};

class FrameDecoder {
 public:
  explicit FrameDecoder(uint32_t max_frame_bytes = kDefaultMaxFrameBytes)
      : max_frame_bytes_(max_frame_bytes) {}

  // Appends bytes and extracts every complete frame. After an error the decoder stays failed.
  // A frame over the limit is an error only once every message before it was popped, since
  // handling those may raise the limit (a scheduler accepts a Hello): call Feed({}) after popping
  // to judge what was held back.
  Status Feed(std::span<const uint8_t> bytes);
  // The limit for frames not yet extracted (e.g. raised once the peer authenticated).
  void set_max_frame_bytes(uint32_t bytes) { max_frame_bytes_ = bytes; }
  uint32_t max_frame_bytes() const { return max_frame_bytes_; }
  // Complete messages, oldest first.
  bool HasMessage() const { return !messages_.empty(); }
  std::unique_ptr<ReceivedMessage> PopMessage();

 private:
  uint32_t max_frame_bytes_;
  std::vector<uint8_t> pending_;
  size_t consumed_ = 0;  // bytes of pending_ already turned into frames
  std::deque<std::unique_ptr<ReceivedMessage>> messages_;
  Status error_;
};

// Cap'n Proto reports malformed messages by throwing kj::Exception when a field is read. Every
// handler of received messages runs under this, which turns that (the peer's fault) into a
// Status. Any other exception is a bug in the handler (a map::at on a missing key, ...): it
// aborts the process here, naming the exception, instead of passing for bad input.
template <typename Fn>
Status CatchMalformed(Fn&& fn) {
  try {
    return fn();
  } catch (const kj::Exception& e) {
    return InvalidArgument("malformed message: {}", e.getDescription().cStr());
  } catch (const std::exception& e) {
    TESSERA_CHECK(false, "a message handler threw (a bug, not bad input): {}", e.what());
  }
}

}  // namespace tessera::rpc
