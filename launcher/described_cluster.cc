#include "launcher/described_cluster.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace tessera::launcher {
namespace {

struct NumberKey {
  const char* key;
  double DescribedCluster::*field;
  bool required;
};

constexpr NumberKey kNumbers[] = {
    {"gpu_memory_gib", &DescribedCluster::gpu_memory_gib, true},
    {"peak_tflops", &DescribedCluster::peak_tflops, true},
    {"memory_gb_per_s", &DescribedCluster::memory_gb_per_s, true},
    {"nvlink_gb_per_s", &DescribedCluster::nvlink_gb_per_s, true},
    {"network_gb_per_s", &DescribedCluster::network_gb_per_s, true},
    {"gemm_efficiency", &DescribedCluster::gemm_efficiency, false},
    {"reserved_gib", &DescribedCluster::reserved_gib, false},
    {"nvlink_latency_us", &DescribedCluster::nvlink_latency_us, false},
    {"network_latency_us", &DescribedCluster::network_latency_us, false},
    {"pcie_gb_per_s", &DescribedCluster::pcie_gb_per_s, false},
    {"host_memory_gib", &DescribedCluster::host_memory_gib, false},
    {"host_memory_gb_per_s", &DescribedCluster::host_memory_gb_per_s, false},
};

Status ErrorAt(const std::string& file, const YAML::Node& node, const std::string& message) {
  return InvalidArgument("{}:{}: {}", file, node.Mark().line + 1, message);
}

Result<double> Number(const std::string& file, const YAML::Node& value, const std::string& key) {
  const std::string text = value.IsScalar() ? value.Scalar() : std::string();
  double parsed = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), parsed);
  if (text.empty() || error != std::errc() || end != text.data() + text.size() ||
      !std::isfinite(parsed)) {
    return ErrorAt(file, value,
                   fmt::format("{} is '{}', not a number; write e.g. {}: 80", key, text, key));
  }
  return parsed;
}

Result<DescribedCluster> ParseRoot(const std::string& file, const YAML::Node& root) {
  if (!root.IsMap()) {
    return ErrorAt(file, root, "a described cluster is a mapping of key: value lines");
  }
  std::vector<std::string> keys = {"name", "gpu", "nodes", "gpus_per_node"};
  for (const NumberKey& number : kNumbers) keys.emplace_back(number.key);
  for (const auto& entry : root) {
    const std::string key = entry.first.Scalar();
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
      return ErrorAt(file, entry.first,
                     fmt::format("unknown key '{}'; the keys are: {}", key, fmt::join(keys, ", ")));
    }
  }
  DescribedCluster cluster;
  cluster.name = std::filesystem::path(file).stem().string();
  if (root["name"]) cluster.name = root["name"].Scalar();
  if (root["gpu"]) cluster.gpu = root["gpu"].Scalar();
  for (const char* key : {"nodes", "gpus_per_node"}) {
    if (!root[key]) {
      return ErrorAt(file, root, fmt::format("missing key '{}' (a whole number >= 1)", key));
    }
    TESSERA_ASSIGN_OR_RETURN(double value, Number(file, root[key], key));
    if (value < 1 || value != std::floor(value) || value > (1 << 20)) {
      return ErrorAt(file, root[key],
                     fmt::format("{} is {}; it must be a whole number >= 1", key, value));
    }
    (std::string_view(key) == "nodes" ? cluster.nodes : cluster.gpus_per_node) =
        static_cast<int>(value);
  }
  for (const NumberKey& number : kNumbers) {
    const YAML::Node value = root[number.key];
    if (!value) {
      if (number.required) {
        return ErrorAt(file, root, fmt::format("missing key '{}' (a number)", number.key));
      }
      continue;
    }
    TESSERA_ASSIGN_OR_RETURN(cluster.*number.field, Number(file, value, number.key));
  }
  TESSERA_RETURN_IF_ERROR(cluster.Validate().WithContext(file));
  return cluster;
}

}  // namespace

Result<DescribedCluster> ParseDescribedCluster(std::string_view text, const std::string& file) {
  // yaml-cpp reports by exceptions; none leaves this function.
  try {
    return ParseRoot(file, YAML::Load(std::string(text)));
  } catch (const YAML::Exception& e) {
    return InvalidArgument("{}:{}: not valid YAML: {}", file, e.mark.line + 1, e.msg);
  }
}

Result<DescribedCluster> ReadDescribedCluster(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return NotFound(
        "cluster file {} cannot be read; give the path of a YAML described cluster "
        "(see examples/clusters/)",
        path);
  }
  std::stringstream text;
  text << in.rdbuf();
  return ParseDescribedCluster(text.str(), path);
}

}  // namespace tessera::launcher
