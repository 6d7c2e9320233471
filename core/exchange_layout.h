// How an all-to-all lays out what it sends and receives (sequence parallelism's exchanges): the
// layouts a model declares for its exchanged outputs (model/model_spec.h) and the all-to-all op
// and collective engine run (core/collective_task.h, worker/collective_engine.cc).
#pragma once

#include <cstdint>
#include <vector>

#include "core/attrs.h"
#include "core/status.h"

namespace tessera {

// How an all-to-all lays out what it sends and receives (attribute "layout", kLayoutAttr), for
// sequence parallelism's swaps between a sequence split and a head split:
//   kBlocks        x and out are group_size contiguous blocks (the default)
//   kToSequence    x [P, B, S, ...] sends block j to rank j; out [B, P S, ...] holds the block
//                  from rank j at positions [j S, (j + 1) S) of each row: a sequence joined
//   kFromSequence  x [B, P S, ...] sends positions [j S, (j + 1) S) of each row to rank j; out
//                  [P, B, S, ...] holds the block from rank j at j
//   kRingNext      ring attention's rotation: x goes whole to the next member (r + 1 mod P) and
//                  out (x's shape) holds the previous member's x: one send and one receive each
//   kRingPrevious  the other way round: x to r - 1, out from r + 1
//   kHaloNext      spatial parallelism's halo (a volume's slabs, member r holding the r-th): x
//                  whole to member r + 1, out (x's shape) the x of r - 1; the last member sends
//                  nothing and the first receives zeros (the volume's zero padding)
//   kHaloPrevious  the other way round: x to r - 1, out from r + 1 (zeros on the last member)
// kToSequence and kFromSequence are each other's adjoint (what an output's gradient goes back
// by), as are kRingNext and kRingPrevious, and kHaloNext and kHaloPrevious; kBlocks is its own.
// kNone: no exchange (a LayerSpec's outputs that are read as they are).
enum class ExchangeLayout : uint8_t {
  kNone,
  kBlocks,
  kToSequence,
  kFromSequence,
  kRingNext,
  kRingPrevious,
  kHaloNext,
  kHaloPrevious
};
inline constexpr const char* kLayoutAttr = "layout";
const char* ExchangeLayoutName(ExchangeLayout layout);  // "none", "blocks", ...
// Attribute "layout" (absent: kBlocks); InvalidArgument naming the choices otherwise.
Result<ExchangeLayout> ExchangeLayoutOf(const Attrs& attrs);
ExchangeLayout AdjointExchange(ExchangeLayout layout);
// Whether `layout` rotates whole buffers around the ring (kRingNext, kRingPrevious) rather than
// trading blocks between every pair.
bool RotatesRing(ExchangeLayout layout);
// Whether `layout` hands whole buffers to one neighbour along a line of members, the ends
// sending nothing (kHaloNext, kHaloPrevious).
bool PassesHalo(ExchangeLayout layout);
// What an all-to-all of `group` members makes of x's dims under `layout`; InvalidArgument
// naming the shape when it does not split so.
Result<std::vector<int64_t>> ExchangedDims(const std::vector<int64_t>& dims, ExchangeLayout layout,
                                           int64_t group);

// Megatron-LM's sequence parallelism (a tensor-parallel model's norms and residuals on 1/T of the
// positions): a reduce_scatter or all_gather with attribute "layout" = "sequence"
// (kSequenceLayout) splits dimension 1 of its whole side [B, S, ...] into `group` consecutive
// parts, member j's part j of every row: the reduce-scatter's x [B, S, ...] gives out
// [B, S / group, ...] (summed), the all-gather's x [B, S / group, ...] gives out [B, S, ...]. Each
// is the other's adjoint. Without the attribute both work on flat blocks.
inline constexpr const char* kSequenceLayout = "sequence";
// Whether `attrs` ask for the sequence split; InvalidArgument for another layout.
Result<bool> SplitsSequence(const Attrs& attrs);
// The dims of the sequence split's other side: x's [B, S, ...] with S multiplied (`gather`) or
// divided by `group`; InvalidArgument naming the shape when S does not split.
Result<std::vector<int64_t>> SequenceSplitDims(const std::vector<int64_t>& dims, int64_t group,
                                               bool gather);

}  // namespace tessera
