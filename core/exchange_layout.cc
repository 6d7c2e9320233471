#include "core/exchange_layout.h"

#include <string>

namespace tessera {

const char* ExchangeLayoutName(ExchangeLayout layout) {
  switch (layout) {
    case ExchangeLayout::kNone:
      return "none";
    case ExchangeLayout::kBlocks:
      return "blocks";
    case ExchangeLayout::kToSequence:
      return "to_sequence";
    case ExchangeLayout::kFromSequence:
      return "from_sequence";
    case ExchangeLayout::kRingNext:
      return "ring_next";
    case ExchangeLayout::kRingPrevious:
      return "ring_previous";
    case ExchangeLayout::kHaloNext:
      return "halo_next";
    case ExchangeLayout::kHaloPrevious:
      return "halo_previous";
  }
  return "?";
}

Result<ExchangeLayout> ExchangeLayoutOf(const Attrs& attrs) {
  if (!attrs.Has(kLayoutAttr)) return ExchangeLayout::kBlocks;
  TESSERA_ASSIGN_OR_RETURN(std::string name, attrs.GetString(kLayoutAttr));
  for (ExchangeLayout layout :
       {ExchangeLayout::kBlocks, ExchangeLayout::kToSequence, ExchangeLayout::kFromSequence,
        ExchangeLayout::kRingNext, ExchangeLayout::kRingPrevious, ExchangeLayout::kHaloNext,
        ExchangeLayout::kHaloPrevious}) {
    if (name == ExchangeLayoutName(layout)) return layout;
  }
  return InvalidArgument(
      "attribute '{}' is '{}'; use blocks, to_sequence, from_sequence, ring_next, "
      "ring_previous, halo_next or halo_previous",
      kLayoutAttr, name);
}

ExchangeLayout AdjointExchange(ExchangeLayout layout) {
  if (layout == ExchangeLayout::kToSequence) return ExchangeLayout::kFromSequence;
  if (layout == ExchangeLayout::kFromSequence) return ExchangeLayout::kToSequence;
  if (layout == ExchangeLayout::kRingNext) return ExchangeLayout::kRingPrevious;
  if (layout == ExchangeLayout::kRingPrevious) return ExchangeLayout::kRingNext;
  if (layout == ExchangeLayout::kHaloNext) return ExchangeLayout::kHaloPrevious;
  if (layout == ExchangeLayout::kHaloPrevious) return ExchangeLayout::kHaloNext;
  return layout;
}

bool RotatesRing(ExchangeLayout layout) {
  return layout == ExchangeLayout::kRingNext || layout == ExchangeLayout::kRingPrevious;
}

bool PassesHalo(ExchangeLayout layout) {
  return layout == ExchangeLayout::kHaloNext || layout == ExchangeLayout::kHaloPrevious;
}

Result<std::vector<int64_t>> ExchangedDims(const std::vector<int64_t>& dims, ExchangeLayout layout,
                                           int64_t group) {
  std::vector<int64_t> out = dims;
  if (layout == ExchangeLayout::kToSequence) {
    if (dims.size() < 3 || dims[0] != group) {
      return InvalidArgument(
          "an all-to-all to the sequence order takes [{}, B, S, ...], not {} dims "
          "led by {}",
          group, dims.size(), dims.empty() ? 0 : dims[0]);
    }
    out.erase(out.begin());
    out[1] *= group;
  } else if (layout == ExchangeLayout::kFromSequence) {
    if (dims.size() < 2 || dims[1] % group != 0) {
      return InvalidArgument(
          "an all-to-all from the sequence order takes [B, S, ...] with S a multiple of {}", group);
    }
    out[1] /= group;
    out.insert(out.begin(), group);
  }
  return out;
}

Result<bool> SplitsSequence(const Attrs& attrs) {
  if (!attrs.Has(kLayoutAttr)) return false;
  TESSERA_ASSIGN_OR_RETURN(std::string name, attrs.GetString(kLayoutAttr));
  if (name != kSequenceLayout) {
    return InvalidArgument("attribute '{}' is '{}'; a reduce-scatter or all-gather takes only '{}'",
                           kLayoutAttr, name, kSequenceLayout);
  }
  return true;
}

Result<std::vector<int64_t>> SequenceSplitDims(const std::vector<int64_t>& dims, int64_t group,
                                               bool gather) {
  if (dims.size() < 2 || group < 1 || (!gather && dims[1] % group != 0)) {
    return InvalidArgument(
        "a sequence split over {} members takes [B, S, ...] with S a multiple of {}, not {} "
        "dims{}",
        group, group, dims.size(), dims.size() >= 2 ? fmt::format(" with S = {}", dims[1]) : "");
  }
  std::vector<int64_t> out = dims;
  out[1] = gather ? dims[1] * group : dims[1] / group;
  return out;
}

}  // namespace tessera
