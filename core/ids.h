// Strongly typed identifiers for the things Tessera names: objects, tasks, workers, graphs.
//
// An id is a 64-bit value wrapped in a distinct type per kind, so an ObjectId can never be
// passed where a TaskId is expected. Value 0 is reserved for "none" (a default-constructed id).
// Ids are assigned by their owner (the graph builder numbers a graph's objects and tasks
// densely from 1; the scheduler numbers workers); they are values, freely copied across threads.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace tessera {

template <typename Tag>
class Id {
 public:
  constexpr Id() = default;
  constexpr explicit Id(uint64_t value) : value_(value) {}

  constexpr uint64_t value() const { return value_; }
  constexpr bool valid() const { return value_ != 0; }

  friend constexpr bool operator==(Id a, Id b) { return a.value_ == b.value_; }
  friend constexpr auto operator<=>(Id a, Id b) { return a.value_ <=> b.value_; }

  std::string ToString() const { return fmt::format("{}{}", Tag::kPrefix, value_); }

 private:
  uint64_t value_ = 0;
};

struct ObjectIdTag {
  static constexpr const char* kPrefix = "obj";
};
struct TaskIdTag {
  static constexpr const char* kPrefix = "task";
};
struct WorkerIdTag {
  static constexpr const char* kPrefix = "worker";
};

using ObjectId = Id<ObjectIdTag>;
using TaskId = Id<TaskIdTag>;
using WorkerId = Id<WorkerIdTag>;

// Hash of a pair of 64-bit ids, e.g. (graph, instance), for unordered containers keyed by it.
struct IdPairHash {
  size_t operator()(const std::pair<uint64_t, uint64_t>& key) const {
    return std::hash<uint64_t>{}(key.first * 0x9e3779b97f4a7c15ULL ^ key.second);
  }
};

}  // namespace tessera

template <typename Tag>
struct std::hash<tessera::Id<Tag>> {
  size_t operator()(tessera::Id<Tag> id) const noexcept {
    return std::hash<uint64_t>()(id.value());
  }
};
