#include "core/timeline.h"

#include "core/collective_task.h"

#include <array>
#include <chrono>

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

}  // namespace tessera
