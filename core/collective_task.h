// Collective tasks: how a graph says "these tasks are the members of one collective".
//
// A collective (an all-reduce of a gradient, an all-gather of a parameter shard, ...) is a group
// of member tasks, one per participating worker, sharing a collective id. Each member is an
// ordinary task of the graph (op all_reduce, reduce_scatter, all_gather, all_gather_in_place,
// all_to_all, broadcast or compressed_all_reduce, see ops/standard_ops.h) whose attributes say
// which collective it belongs to and its rank:
//
//   collective   int   the collective's id, unique within the graph; members share it
//   rank         int   this member's rank, 0 .. group_size-1, each exactly once
//   group_size   int   how many members
//   channel      int   optional (0): which of the worker's communication channels runs it,
//                      0 .. kCollectiveChannels-1; members share it
//
// Channels. A worker runs each channel's members in order on a thread of their own, over
// communicators of their own, so collectives on different channels progress at once: a plan puts
// what must not wait behind another kind of collective on a channel of its own (ZeRO-3's
// parameter gathers, which would otherwise queue behind the gradient reductions and could not be
// prefetched in the backward pass). Within a channel the order below holds.
//
// Members are placed on distinct workers (pinned by the planner, or spread by the scheduler);
// the workers in rank order form the collective's group, which gets one communicator per worker,
// created the first time the group meets and reused by every later collective of that group.
// When the scheduler places the graph it adds:
//
//   group        int   the cluster-wide key of the group on this channel (the communicator)
//   position     int   the member's place among the instance's members on its worker and
//                      channel, in one global order consistent with the graph's dependencies
//                      (OrderCollectives)
//
// and each instance adds, per worker and channel, a base (RunGraph's collectiveBases): where its
// members start in that worker's order of the channel's collectives, counted over every instance
// the scheduler started there (registered graphs' steps, submitted collectives alike). Every
// worker runs each channel's members in that order, so no two workers ever wait on each other in
// opposite orders (no deadlock): each channel's order is a part of one global order consistent
// with every dependency, and channels wait on nothing of each other's.
//
// The scheduler reads these attributes without linking the ops (hence this header in core).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>
#include <vector>

#include "core/exchange_layout.h"
#include "core/graph.h"
#include "core/status.h"

namespace tessera {

inline constexpr const char* kCollectiveAttr = "collective";
inline constexpr const char* kRankAttr = "rank";
inline constexpr const char* kGroupSizeAttr = "group_size";
inline constexpr const char* kGroupAttr = "group";
inline constexpr const char* kPositionAttr = "position";
inline constexpr const char* kChannelAttr = "channel";

// compressed_all_reduce's count: how many of x's leading elements it compresses and averages (a
// group's own elements; the rest, padding to a sharding's multiple, pass through as they are).
// Absent: all of them.
inline constexpr const char* kCompressedCountAttr = "count";

// all_gather and reduce_scatter's quantize_bits: the payload block-quantized to 8 or 4 bits
// (core/block_quantization.h, collectives/quantized.h: ZeRO++'s qwZ and qgZ), f32 only. Absent:
// exact.
inline constexpr const char* kQuantizeBitsAttr = "quantize_bits";

// A worker's communication channels (threads and communicators of their own, per group).
inline constexpr int kCollectiveChannels = 4;
// The channel of ZeRO-3's parameter gathers (the rest use channel 0 but tensor parallelism's).
inline constexpr int kGatherChannel = 1;
// The channel of tensor parallelism's all-reduces of activations and their gradients.
inline constexpr int kTensorChannel = 2;

// No collective has more members than this: a cluster of Tessera's kind has far fewer workers,
// and a group size read from the wire must be bounded before anything is sized by it.
inline constexpr int64_t kMaxCollectiveGroupSize = 4096;
// No graph has more collectives than this: ordering them costs memory quadratic in their number
// (OrderCollectives), and a count read from the wire must be bounded before anything is sized by
// it. A step graph of a large model has a few thousand at most.
inline constexpr size_t kMaxCollectivesPerGraph = 4096;

struct CollectiveMembership {
  int64_t collective = 0;
  int rank = 0;
  int group_size = 1;
  int channel = 0;
};

// Where a member runs on its worker: its channel, and its place in the channel's order.
struct CollectivePlace {
  int channel = 0;
  int64_t position = 0;
  auto operator<=>(const CollectivePlace&) const = default;
};

// Moves `group` blocks between the block order [P, B, S, row] (`blocks`) and the sequence order
// [B, P S, row] (`sequence`), `row_bytes` bytes a position: to the sequence order when
// `to_sequence`, else back.
void MoveSequenceBlocks(void* sequence, void* blocks, int64_t group, int64_t batch,
                        int64_t positions, int64_t row_bytes, bool to_sequence);

// nullopt for an ordinary task; InvalidArgument naming the task when the attributes are
// inconsistent (a rank outside the group, a missing group_size, a group larger than
// kMaxCollectiveGroupSize, a channel outside 0 .. kCollectiveChannels-1).
Result<std::optional<CollectiveMembership>> CollectiveOf(const TaskSpec& task);

// Whether `op` is one of the collective ops (all_reduce, reduce_scatter, all_gather,
// all_gather_in_place, all_to_all, broadcast, compressed_all_reduce).
bool IsCollectiveOp(std::string_view op);

// A compressed all-reduce's count (kCompressedCountAttr) over an x of `numel` elements;
// InvalidArgument when it is not 1 .. numel (or 0 for an empty x).
Result<int64_t> CompressedCount(const Attrs& attrs, int64_t numel);

// Checks every collective among `tasks`: members of one collective agree on group_size and
// channel, have the ranks 0 .. group_size-1 exactly once, and run the same op. InvalidArgument
// naming the collective and what is wrong.
Status ValidateCollectives(const std::vector<TaskSpec>& tasks);

// The graph's collectives in an order every worker can follow: if any member of B depends,
// through any chain of tasks (inputs and control edges, TaskSpec::after), on a member of A, then
// A comes first (ties: the collective whose first member comes first in `tasks`).
// `producer_of(object)` is the task producing an object (invalid for graph inputs). REQUIRES:
// tasks have dense ids 1..n (in any order: control edges may point forward). InvalidArgument
// naming two collectives that depend on each other (no order can avoid a deadlock), when the
// tasks wait for each other in a cycle, or when there are more than kMaxCollectivesPerGraph
// collectives.
Result<std::vector<int64_t>> OrderCollectives(const std::vector<TaskSpec>& tasks,
                                              const std::function<TaskId(ObjectId)>& producer_of);

}  // namespace tessera
