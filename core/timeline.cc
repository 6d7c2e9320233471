#include "core/timeline.h"

#include "core/collective_task.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <limits>
#include <map>

#include <fmt/format.h>

namespace tessera {

namespace {

bool EndsWith(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

bool StartsWith(std::string_view text, std::string_view prefix) {
  return text.substr(0, prefix.size()) == prefix;
}

bool Contains(std::string_view text, std::string_view part) {
  return text.find(part) != std::string_view::npos;
}

template <size_t N>
bool OneOf(std::string_view op, const std::array<std::string_view, N>& ops) {
  for (std::string_view candidate : ops) {
    if (op == candidate) return true;
  }
  return false;
}

constexpr std::array<std::string_view, 2> kTransferOps = {"copy", "write_file"};
// Prefixes: an op "adamw_fused" or "clip_by_norm" is an optimizer op too.
constexpr std::array<std::string_view, 6> kOptimizerPrefixes = {
    "adamw", "sgd", "clip", "grad_norm", "sum_of_squares", "optimizer"};
constexpr std::array<std::string_view, 3> kBackwardOps = {"loss_gradient", "accumulate",
                                                          "reshape_backward"};
constexpr std::array<std::string_view, 5> kForwardOps = {
    "softmax_cross_entropy", "voxel_cross_entropy", "tied_lm_head_logits", "reshape", "dice_score"};

}  // namespace

std::string_view SpanKindName(SpanKind kind) {
  switch (kind) {
    case SpanKind::kForward:
      return "forward";
    case SpanKind::kBackward:
      return "backward";
    case SpanKind::kBackwardInput:
      return "backward_input";
    case SpanKind::kBackwardWeight:
      return "backward_weight";
    case SpanKind::kOptimizer:
      return "optimizer";
    case SpanKind::kCollective:
      return "collective";
    case SpanKind::kTransfer:
      return "transfer";
    case SpanKind::kOther:
      return "other";
  }
  return "other";
}

// The name without a micro-batch suffix: "h.0/backward_input@3" -> "h.0/backward_input".
std::string_view WithoutMicroBatch(std::string_view name) {
  const size_t at = name.rfind('@');
  if (at == std::string_view::npos || at + 1 == name.size()) return name;
  for (size_t i = at + 1; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return name;
  }
  return name.substr(0, at);
}

SpanKind ClassifyTask(std::string_view name, std::string_view op) {
  if (IsCollectiveOp(op)) return SpanKind::kCollective;
  if (EndsWith(WithoutMicroBatch(name), "/backward_input")) return SpanKind::kBackwardInput;
  if (EndsWith(WithoutMicroBatch(name), "/backward_weight")) return SpanKind::kBackwardWeight;
  if (OneOf(op, kTransferOps)) return SpanKind::kTransfer;
  // The last path component of the name says what the task is for ("rank1/grad_norm/sum").
  const size_t slash = name.rfind('/');
  const std::string_view leaf = slash == std::string_view::npos ? name : name.substr(slash + 1);
  if (Contains(name, "grad_norm/")) return SpanKind::kOptimizer;  // "grad_norm/sum"
  for (std::string_view prefix : kOptimizerPrefixes) {
    if (StartsWith(op, prefix) || StartsWith(leaf, prefix)) return SpanKind::kOptimizer;
  }
  if (EndsWith(op, "_backward") || OneOf(op, kBackwardOps)) return SpanKind::kBackward;
  if (EndsWith(op, "_forward") || OneOf(op, kForwardOps)) return SpanKind::kForward;
  if (Contains(name, "backward")) return SpanKind::kBackward;
  if (Contains(name, "forward")) return SpanKind::kForward;
  return SpanKind::kOther;
}

std::string StreamName(int stream) {
  if (stream == kTransferStream) return "transfer";
  if (stream == kCollectiveStream) return "collective";
  return fmt::format("compute {}", stream);
}

int64_t SystemMicrosNow() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

namespace {

uint64_t ZigZag(int64_t value) {
  return (static_cast<uint64_t>(value) << 1) ^ static_cast<uint64_t>(value >> 63);
}
int64_t UnZigZag(uint64_t value) {
  return static_cast<int64_t>(value >> 1) ^ -static_cast<int64_t>(value & 1);
}

// Appends varints to a string, a record (at most five of at most ten bytes) at a time.
class VarintWriter {
 public:
  explicit VarintWriter(size_t expected_bytes) : out_(expected_bytes + kRecordMostBytes, '\0') {}

  // Makes room for one more record (or the counts).
  void Reserve() {
    if (used_ + kRecordMostBytes > out_.size()) out_.resize(2 * out_.size() + kRecordMostBytes);
  }
  void Put(uint64_t value) {
    auto* at = reinterpret_cast<uint8_t*>(out_.data()) + used_;
    while (value >= 0x80) {
      *at++ = static_cast<uint8_t>(value | 0x80);
      value >>= 7;
    }
    *at++ = static_cast<uint8_t>(value);
    used_ = static_cast<size_t>(at - reinterpret_cast<uint8_t*>(out_.data()));
  }
  // Appends one record: its id and start as differences from `previous_id` / `previous_start`
  // (which it then becomes), `middle` (a task's zigzagged stream, a push's destination) as it is.
  void PutRecord(uint64_t id, uint64_t middle, int64_t start_us, int64_t end_us, int64_t bytes,
                 uint64_t& previous_id, int64_t& previous_start) {
    Reserve();
    Put(ZigZag(static_cast<int64_t>(id - previous_id)));
    Put(middle);
    // Unsigned arithmetic: wraps instead of overflowing; the reader wraps it back.
    Put(ZigZag(static_cast<int64_t>(static_cast<uint64_t>(start_us) -
                                    static_cast<uint64_t>(previous_start))));
    Put(static_cast<uint64_t>(end_us) - static_cast<uint64_t>(start_us));
    Put(static_cast<uint64_t>(bytes));
    previous_id = id;
    previous_start = start_us;
  }
  std::string Take() && {
    out_.resize(used_);
    return std::move(out_);
  }

 private:
  static constexpr size_t kRecordMostBytes = size_t{5} * 10;
  std::string out_;
  size_t used_ = 0;
};

class SpanReader {
 public:
  explicit SpanReader(std::string_view packed) : packed_(packed) {}

  // False (and error() says why, naming `what`) at the end of the packing or past 64 bits.
  bool Varint(uint64_t& value, const char* what) {
    if (at_ < packed_.size() && static_cast<uint8_t>(packed_[at_]) < 0x80) {
      value = static_cast<uint8_t>(packed_[at_++]);  // most values: one byte
      return true;
    }
    value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (at_ >= packed_.size()) {
        error_ = InvalidArgument("packed spans end inside a {} (byte {} of {})", what, at_,
                                 packed_.size());
        return false;
      }
      const auto byte = static_cast<uint8_t>(packed_[at_++]);
      if (shift == 63 && byte > 1) break;
      value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    error_ = InvalidArgument("packed spans: a {} over 64 bits at byte {}", what, at_ - 1);
    return false;
  }

  struct Record {
    uint64_t id = 0;
    uint64_t middle = 0;
    int64_t start_us = 0;
    int64_t end_us = 0;
    int64_t bytes = 0;
  };
  // The next record, its id and start added to the previous record's. False: error() says why.
  bool Next(Record& record, uint64_t& previous_id, int64_t& previous_start) {
    uint64_t id_delta = 0, start_delta = 0, duration = 0, bytes = 0;
    if (!Varint(id_delta, "span id") || !Varint(record.middle, "span stream or destination") ||
        !Varint(start_delta, "span start") || !Varint(duration, "span duration") ||
        !Varint(bytes, "span bytes")) {
      return false;
    }
    record.id = previous_id + static_cast<uint64_t>(UnZigZag(id_delta));
    record.start_us = static_cast<int64_t>(static_cast<uint64_t>(previous_start) +
                                           static_cast<uint64_t>(UnZigZag(start_delta)));
    if (duration > static_cast<uint64_t>(INT64_MAX) ||
        __builtin_add_overflow(record.start_us, static_cast<int64_t>(duration), &record.end_us)) {
      error_ = InvalidArgument(
          "packed spans: a span from {} us lasting {} us (ends before it starts, or past any "
          "time)",
          record.start_us, duration);
      return false;
    }
    if (record.start_us < 0 || record.end_us > kMaxSpanMicros) {
      error_ = InvalidArgument("packed spans: span [{}, {}] us is outside [0, {}]", record.start_us,
                               record.end_us, kMaxSpanMicros);
      return false;
    }
    if (bytes > static_cast<uint64_t>(INT64_MAX)) {
      error_ = InvalidArgument("packed spans: a span of {} bytes", bytes);
      return false;
    }
    record.bytes = static_cast<int64_t>(bytes);
    previous_id = record.id;
    previous_start = record.start_us;
    return true;
  }

  size_t left() const { return packed_.size() - at_; }
  const Status& error() const { return error_; }

 private:
  std::string_view packed_;
  size_t at_ = 0;
  Status error_;
};

// Each record is at least five bytes (five varints).
constexpr uint64_t kMinRecordBytes = 5;

// The packing's two counts, checked against what its bytes can hold.
Result<PackedSpanCounts> ReadCounts(SpanReader& reader, size_t packed_bytes) {
  PackedSpanCounts counts;
  if (!reader.Varint(counts.tasks, "count of tasks") ||
      !reader.Varint(counts.pushes, "count of pushes")) {
    return reader.error();
  }
  if (counts.tasks > reader.left() / kMinRecordBytes ||
      counts.pushes > reader.left() / kMinRecordBytes - counts.tasks) {
    return InvalidArgument("packed spans count {} tasks and {} pushes in {} bytes", counts.tasks,
                           counts.pushes, packed_bytes);
  }
  return counts;
}

// Reads `packed`, calling on_task(task) and on_push(push) with each record in order.
template <typename OnTask, typename OnPush>
Status ReadPackedSpans(std::string_view packed, OnTask on_task, OnPush on_push) {
  SpanReader reader(packed);
  TESSERA_ASSIGN_OR_RETURN(const PackedSpanCounts counts, ReadCounts(reader, packed.size()));
  const uint64_t tasks = counts.tasks, pushes = counts.pushes;
  uint64_t previous_id = 0;
  int64_t previous_start = 0;
  SpanReader::Record record;
  for (uint64_t i = 0; i < tasks; ++i) {
    if (!reader.Next(record, previous_id, previous_start)) return reader.error();
    const int64_t stream = UnZigZag(record.middle);
    if (stream != kCollectiveStream && (stream < 0 || stream > INT16_MAX)) {
      return InvalidArgument("packed spans: task {} on stream {}, which no process has", record.id,
                             stream);
    }
    on_task(WorkerSpans::Task{record.id, static_cast<int>(stream), record.start_us, record.end_us,
                              record.bytes});
  }
  previous_id = 0;
  previous_start = 0;
  for (uint64_t i = 0; i < pushes; ++i) {
    if (!reader.Next(record, previous_id, previous_start)) return reader.error();
    on_push(
        WorkerSpans::Push{record.id, record.middle, record.start_us, record.end_us, record.bytes});
  }
  if (reader.left() != 0) {
    return InvalidArgument("packed spans: {} bytes after the last record", reader.left());
  }
  return Status::Ok();
}

}  // namespace

std::string PackSpans(const WorkerSpans& spans) {
  // Typical spans take 5-6 bytes.
  VarintWriter out(6 * (spans.tasks.size() + spans.pushes.size()));
  out.Reserve();
  out.Put(spans.tasks.size());
  out.Put(spans.pushes.size());
  uint64_t previous_id = 0;
  int64_t previous_start = 0;
  for (const WorkerSpans::Task& task : spans.tasks) {
    out.PutRecord(task.task, ZigZag(task.stream), task.start_us, task.end_us, task.bytes,
                  previous_id, previous_start);
  }
  previous_id = 0;
  previous_start = 0;
  for (const WorkerSpans::Push& push : spans.pushes) {
    out.PutRecord(push.object, push.destination, push.start_us, push.end_us, push.bytes,
                  previous_id, previous_start);
  }
  return std::move(out).Take();
}

Result<WorkerSpans> UnpackSpans(std::string_view packed) {
  WorkerSpans spans;
  spans.tasks.reserve(packed.size() / 6);
  TESSERA_RETURN_IF_ERROR(ReadPackedSpans(
      packed, [&](const WorkerSpans::Task& task) { spans.tasks.push_back(task); },
      [&](const WorkerSpans::Push& push) { spans.pushes.push_back(push); }));
  return spans;
}

Result<PackedSpanCounts> CountPackedSpans(std::string_view packed) {
  SpanReader reader(packed);
  return ReadCounts(reader, packed.size());
}

Status CheckPackedSpans(std::string_view packed) {
  return ReadPackedSpans(
      packed, [](const WorkerSpans::Task&) {}, [](const WorkerSpans::Push&) {});
}

double TaskSpanMs(const Timeline& timeline) {
  int64_t first = std::numeric_limits<int64_t>::max(), last = std::numeric_limits<int64_t>::min();
  for (const TimelineSpan& span : timeline.spans) {
    if (span.stream == kTransferStream) continue;
    first = std::min(first, span.start_us);
    last = std::max(last, span.end_us);
  }
  return last > first ? static_cast<double>(last - first) / 1e3 : 0.0;
}

OverlapFigures HiddenUnderCompute(const Timeline& timeline,
                                  const std::function<bool(const TimelineSpan&)>& selected) {
  // Per worker, its compute as disjoint intervals (merged, by start).
  std::map<WorkerId, std::vector<std::pair<int64_t, int64_t>>> compute;
  for (const TimelineSpan& span : timeline.spans) {
    if (span.stream < 0 || span.kind == SpanKind::kCollective || span.kind == SpanKind::kTransfer) {
      continue;
    }
    compute[span.worker].emplace_back(span.start_us, span.end_us);
  }
  for (auto& [worker, intervals] : compute) {
    std::sort(intervals.begin(), intervals.end());
    std::vector<std::pair<int64_t, int64_t>> merged;
    for (const auto& interval : intervals) {
      if (!merged.empty() && interval.first <= merged.back().second) {
        merged.back().second = std::max(merged.back().second, interval.second);
      } else {
        merged.push_back(interval);
      }
    }
    intervals = std::move(merged);
  }
  OverlapFigures figures;
  for (const TimelineSpan& span : timeline.spans) {
    if (!selected(span)) continue;
    ++figures.spans;
    figures.total_us += span.end_us - span.start_us;
    auto worker = compute.find(span.worker);
    if (worker == compute.end()) continue;
    const auto& intervals = worker->second;
    // The first interval that ends after the span starts, then every one that starts before it
    // ends.
    auto it = std::lower_bound(intervals.begin(), intervals.end(), span.start_us,
                               [](const std::pair<int64_t, int64_t>& interval, int64_t at) {
                                 return interval.second <= at;
                               });
    for (; it != intervals.end() && it->first < span.end_us; ++it) {
      figures.hidden_us += std::min(it->second, span.end_us) - std::max(it->first, span.start_us);
    }
  }
  return figures;
}

}  // namespace tessera
