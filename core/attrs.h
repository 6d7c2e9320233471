// Attributes of a task: a small, ordered map from name to int, float, string or int list.
//
// Attributes carry what an op needs beyond its input tensors (number of heads, epsilon, the
// AdamW betas, ...). They are part of the TaskSpec and travel with it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "core/status.h"

namespace tessera {

using AttrValue = std::variant<int64_t, double, std::string, std::vector<int64_t>>;

class Attrs {
 public:
  Attrs() = default;
  Attrs(std::initializer_list<std::pair<const std::string, AttrValue>> values) : values_(values) {}

  Attrs& Set(const std::string& name, AttrValue value) {
    values_[name] = std::move(value);
    return *this;
  }
  bool Has(const std::string& name) const { return values_.contains(name); }

  // InvalidArgument naming the attribute when missing or of another type.
  Result<int64_t> GetInt(const std::string& name) const;
  Result<double> GetFloat(const std::string& name) const;  // an int attribute converts
  Result<std::string> GetString(const std::string& name) const;
  Result<std::vector<int64_t>> GetInts(const std::string& name) const;

  int64_t GetInt(const std::string& name, int64_t fallback) const;
  double GetFloat(const std::string& name, double fallback) const;

  const std::map<std::string, AttrValue>& values() const { return values_; }
  friend bool operator==(const Attrs&, const Attrs&) = default;
  // "{eps=1e-05, heads=4}"
  std::string ToString() const;

 private:
  std::map<std::string, AttrValue> values_;
};

}  // namespace tessera
