#include "core/attrs.h"

#include <fmt/ranges.h>

namespace tessera {

namespace {
template <typename T>
Result<T> GetTyped(const std::map<std::string, AttrValue>& values, const std::string& name,
                   const char* type_name) {
  auto it = values.find(name);
  if (it == values.end()) return InvalidArgument("missing attribute '{}'", name);
  if (const T* value = std::get_if<T>(&it->second)) return *value;
  return InvalidArgument("attribute '{}' is not of type {}", name, type_name);
}
}  // namespace

Result<int64_t> Attrs::GetInt(const std::string& name) const {
  return GetTyped<int64_t>(values_, name, "int");
}

Result<double> Attrs::GetFloat(const std::string& name) const {
  auto it = values_.find(name);
  if (it != values_.end()) {
    if (const int64_t* value = std::get_if<int64_t>(&it->second)) {
      return static_cast<double>(*value);
    }
  }
  return GetTyped<double>(values_, name, "float");
}

Result<std::string> Attrs::GetString(const std::string& name) const {
  return GetTyped<std::string>(values_, name, "string");
}

Result<std::vector<int64_t>> Attrs::GetInts(const std::string& name) const {
  return GetTyped<std::vector<int64_t>>(values_, name, "int list");
}

int64_t Attrs::GetInt(const std::string& name, int64_t fallback) const {
  Result<int64_t> value = GetInt(name);
  return value.ok() ? *value : fallback;
}

double Attrs::GetFloat(const std::string& name, double fallback) const {
  Result<double> value = GetFloat(name);
  return value.ok() ? *value : fallback;
}

std::string Attrs::ToString() const {
  std::vector<std::string> parts;
  for (const auto& [name, value] : values_) {
    std::string text = std::visit(
        [](const auto& v) -> std::string {
          using V = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<V, std::vector<int64_t>>) {
            return fmt::format("[{}]", fmt::join(v, ","));
          } else {
            return fmt::format("{}", v);
          }
        },
        value);
    parts.push_back(fmt::format("{}={}", name, text));
  }
  return fmt::format("{{{}}}", fmt::join(parts, ", "));
}

}  // namespace tessera
