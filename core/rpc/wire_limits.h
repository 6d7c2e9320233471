// WireLimits: what one control-plane message may hold, and the check every received message
// passes before anything reads it.
//
// A peer (a driver, a worker, anything that learned the token, or a bug) controls every count,
// size, rank and index in a message it sends. Nothing read off the wire may size an allocation
// or index a container before it is range-checked against what the cluster can hold. The
// validated decoding layer has two parts, both here and in wire.h, both taking these limits:
//
//   1. CheckEnvelope: every list's length and every text's or blob's size in the message, by
//      message kind, before the message is routed. A Cap'n Proto list of zero-sized elements
//      costs its sender nothing and can claim millions of entries: this is what stops a reader
//      from making one object per claimed entry.
//   2. FromWire (wire.h): the values: ranks and dimensions of tensors (and their bytes, without
//      overflow), dtypes and devices, attribute counts and sizes, a collective member's rank and
//      group size, donation slots, span streams.
//
// Errors are InvalidArgument naming the field, its value and the limit (and the setting that
// raises it), e.g. "SubmitTasks.tasks has 300000 entries, more than the limit of 262144
// (TESSERA_WIRE_MAX_TASKS)". The receiver refuses the message (the scheduler answers the sender
// with the reason and disconnects it; everyone else is served as before).
//
// The defaults are the settings' (core/settings_def.h, wire_max_*); WireLimits{} is the same.
//
// Thread safety: a value; the functions keep no state.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/collective_task.h"
#include "core/proto/tessera.capnp.h"
#include "core/settings.h"
#include "core/status.h"

namespace tessera::rpc {

struct WireLimits {
  int64_t max_tasks = 262144;     // tasks in one message; names and per-task lists of a run
  int64_t max_objects = 1048576;  // entries of any list of objects, ids, bindings or spans
  int64_t max_group_size = kMaxCollectiveGroupSize;  // members of one collective
  int64_t max_tensor_bytes = int64_t{1} << 40;       // bytes of one declared object
  int64_t max_attr_bytes = int64_t{16} << 20;        // one attribute value, error text or blob
  int64_t max_name_bytes = 4096;                     // one name, address, host, token
  // Not settings: the format's own bounds.
  int64_t max_tensor_rank = 16;
  int64_t max_attrs = 1024;  // attributes of one task
  int64_t max_role_peaks = 64;
  int64_t max_host_bytes = int64_t{1} << 50;  // a host's memory or disk figure (1 PiB)
  int64_t max_millis = int64_t{1} << 40;      // a duration the receiver does clock arithmetic
                                              // with, in ms (about 35 years)

  // The limits the settings give (wire_max_*), taken as they are: Check says whether they are
  // usable.
  static WireLimits FromSettings(const Settings& settings);
  // InvalidArgument naming the setting when a limit is not positive, or the group size is above
  // kMaxCollectiveGroupSize.
  Status Check() const;
};

// InvalidArgument "<field> has <count> entries, more than the limit of <limit> (<setting>)"
// when count > limit; `setting` may be empty (a bound of the format itself).
Status CheckCount(std::string_view field, uint64_t count, int64_t limit,
                  std::string_view setting = "");
// InvalidArgument "<field> is <bytes> bytes long, more than the limit of <limit> (<setting>)".
Status CheckBytes(std::string_view field, uint64_t bytes, int64_t limit,
                  std::string_view setting = "");

// InvalidArgument "<field> is <value> bytes, outside [0, <limit>]": a figure the receiver does
// arithmetic with (a host's capacity, its memory in use), bounded so no sum or difference of
// them overflows.
Status CheckByteFigure(std::string_view field, int64_t value, int64_t limit);

// Checks every list's length and every text's and blob's size of `message` against `limits`,
// the hosts' byte figures of Hello and Heartbeat, and CollectiveFailed's silence (at most
// limits.max_millis: it is subtracted from a clock); the values inside lists are FromWire's to
// check. InvalidArgument naming the first field
// over its limit. Malformed structure throws kj::Exception (the caller runs under
// CatchMalformed, frame.h).
Status CheckEnvelope(proto::Envelope::Reader message, const WireLimits& limits);

// The parts CheckEnvelope checks, for readers of a part outside an envelope (tests, fuzzers).
Status CheckTask(proto::Task::Reader task, const WireLimits& limits);
Status CheckObjectDecl(proto::ObjectDecl::Reader decl, const WireLimits& limits);

}  // namespace tessera::rpc
