// Timeline: where the time of training steps went, task by task, on every worker.
//
// A span is one interval on one stream of one process: a task on a compute thread slot, a
// collective member on the worker's communication stream, or an object pushed to another worker
// on its transfer stream. Times are absolute microseconds of the system clock
// (std::chrono::system_clock since the Unix epoch), so spans from processes on one host, or on
// hosts whose clocks are NTP-synced, line up on one axis.
//
// Where spans come from:
//   - the in-process executor times every task (worker/in_process_executor.h, RunStats::timings);
//   - on a cluster each worker sends its spans of a graph instance with InstanceFinished, as
//     compact records (WorkerSpans: task ids, not names) packed (PackSpans); the scheduler keeps
//     the packings of the last `trace_instances` instances, and adds names, layers and ops from
//     the registered graph when a driver's or the CLI's TimelineRequest asks for them
//     (scheduler/trace_store.h);
//   - client/trace.h writes a Timeline as Chrome/Perfetto trace JSON.
//
// Plain data, no thread-safety concerns.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/ids.h"
#include "core/status.h"

namespace tessera {

// What a span's task does in a training step.
enum class SpanKind : uint8_t {
  kForward,
  kBackward,
  kBackwardInput,   // "<name>/backward_input": the "B" of a zero-bubble split backward
  kBackwardWeight,  // "<name>/backward_weight": its "W"
  kOptimizer,       // adamw, sgd, clipping, gradient norms
  kCollective,      // all_reduce, reduce_scatter, all_gather, all_to_all, broadcast members
  kTransfer,        // copies between workers or tiers, and pushes of objects
  kOther,
};
inline constexpr int kSpanKinds = 8;

// "forward", "backward", "backward_input", "backward_weight", "optimizer", "collective",
// "transfer", "other".
std::string_view SpanKindName(SpanKind kind);

// Classifies a task by its name and op (a pure function of both). In order:
//   1. collective ops (all_reduce, reduce_scatter, all_gather, all_gather_in_place, all_to_all,
//      broadcast: IsCollectiveOp) -> kCollective;
//   2. a name ending "/backward_input" or "/backward_weight", before any micro-batch suffix
//      ("@3") -> kBackwardInput / kBackwardWeight;
//   3. transfer ops (copy, write_file, ...) -> kTransfer;
//   4. optimizer ops (adamw*, sgd*, clip*, grad_norm*, sum_of_squares*, ...) -> kOptimizer;
//   5. an op or name ending "_backward" or containing "backward" -> kBackward;
//   6. an op or name ending "_forward" or containing "forward", and loss ops -> kForward;
//   7. otherwise kOther.
SpanKind ClassifyTask(std::string_view name, std::string_view op);

// Streams of a process: compute thread slots are >= 0.
inline constexpr int kTransferStream = -1;
inline constexpr int kCollectiveStream = -2;
// "compute 3", "transfer", "collective".
std::string StreamName(int stream);

// What one worker recorded for one graph instance: compact, names resolved by the receiver.
struct WorkerSpans {
  struct Task {
    uint64_t task = 0;  // the task's id in the graph (graph-local, 1-based)
    int stream = 0;     // compute slot, or kCollectiveStream for collective members
    int64_t start_us = 0;
    int64_t end_us = 0;
    int64_t bytes = 0;  // collective members: bytes this member sent; copies between tiers:
                        // bytes copied
  };
  struct Push {
    uint64_t object = 0;       // the object's id in the graph (graph-local, 1-based)
    uint64_t destination = 0;  // the worker it went to
    int64_t start_us = 0;
    int64_t end_us = 0;
    int64_t bytes = 0;
  };
  std::vector<Task> tasks;
  std::vector<Push> pushes;
};

// Span times are microseconds since the Unix epoch. Times read from another process are bounded
// to [0, kMaxSpanMicros] so that their readers' differences cannot overflow.
inline constexpr int64_t kMaxSpanMicros = int64_t{1} << 60;

// WorkerSpans in the packed form InstanceFinished carries and the scheduler keeps: about 6
// bytes a span instead of the 40 of a record (traces cost a few percent of a run of many small
// tasks, not a third). Unsigned LEB128 varints; a record's id and start are differences from the
// record before it (zigzag-coded: spans come roughly in id and time order, so they are small),
// its duration and bytes are as they are:
//   count of tasks, count of pushes,
//   per task:  zigzag(task - previous task), zigzag(stream), zigzag(start - previous start),
//              end - start, bytes
//   per push:  zigzag(object - previous object), destination, zigzag(start - previous start),
//              end - start, bytes
// ("previous" starts at 0 for the tasks and again for the pushes).
std::string PackSpans(const WorkerSpans& spans);
// InvalidArgument naming what is wrong for a packing that is truncated, has bytes after its last
// record, counts more records than its bytes can hold, or holds a span that ends before it starts,
// lies outside [0, kMaxSpanMicros], has negative bytes or names a stream that is neither a compute
// slot nor the collective stream.
Result<WorkerSpans> UnpackSpans(std::string_view packed);
// The checks of UnpackSpans without building the records: for a receiver that keeps the packing.
Status CheckPackedSpans(std::string_view packed);
// The counts a packing declares, read without its records: InvalidArgument for counts its bytes
// cannot hold (a cheap check before anything is sized by them).
struct PackedSpanCounts {
  uint64_t tasks = 0;
  uint64_t pushes = 0;
};
Result<PackedSpanCounts> CountPackedSpans(std::string_view packed);

struct TimelineProcess {
  WorkerId worker;  // invalid: the driver's own process (in-process backend)
  std::string hostname;
  int pid = 0;
};

struct TimelineSpan {
  WorkerId worker;
  int stream = 0;  // compute slot, kTransferStream or kCollectiveStream
  std::string name;
  std::string layer;
  std::string op;
  SpanKind kind = SpanKind::kOther;
  int64_t start_us = 0;  // system clock, microseconds since the Unix epoch
  int64_t end_us = 0;
  int64_t bytes = 0;  // pushes and collective members: bytes sent; copies between tiers: copied
  uint64_t graph = 0;
  uint64_t instance = 0;
};

struct Timeline {
  std::vector<TimelineProcess> processes;
  std::vector<TimelineSpan> spans;
};

// Microseconds of the system clock now (the time base of every span).
int64_t SystemMicrosNow();

// From the first task's start to the last task's end on any worker, in milliseconds (the spans of
// pushes between workers, kTransferStream, aside): the part of a step its tasks take, the rest
// being the step's start and end (inputs sent, instances started, reports collected). 0 when
// no task ran.
double TaskSpanMs(const Timeline& timeline);

// How much of some spans' time their worker spent computing too: the overlap figure of a trace
// (e.g. how much of ZeRO-3's gathers the compute hid). Compute is every span on a compute slot
// (stream >= 0) of a kind other than collective and transfer.
struct OverlapFigures {
  int64_t spans = 0;       // spans selected
  int64_t total_us = 0;    // their summed durations
  int64_t hidden_us = 0;   // of that, the time their worker was also computing
  double hidden() const {  // fraction hidden; 0 when nothing was selected
    return total_us > 0 ? static_cast<double>(hidden_us) / static_cast<double>(total_us) : 0.0;
  }
};
OverlapFigures HiddenUnderCompute(const Timeline& timeline,
                                  const std::function<bool(const TimelineSpan&)>& selected);

}  // namespace tessera
