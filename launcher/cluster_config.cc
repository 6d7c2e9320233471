#include "launcher/cluster_config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

namespace tessera::launcher {
namespace {

// "<file>:<line>: <message>". Lines count from 1.
template <typename... Args>
Status ErrorAt(const std::string& file, int line, fmt::format_string<Args...> format,
               Args&&... args) {
  return InvalidArgument("{}:{}: {}", file, line, fmt::format(format, std::forward<Args>(args)...));
}

int LineOf(const YAML::Node& node) { return node.Mark().line + 1; }

std::string StemOf(const std::string& file) { return std::filesystem::path(file).stem().string(); }

bool ValidName(std::string_view name) {
  return !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-';
  });
}

// A host name or address: letters, digits, '.', '-', ':' (IPv6), '_'. Anything else would have
// to be quoted through two shells and is surely a mistake.
bool ValidHost(std::string_view host) {
  return !host.empty() && std::all_of(host.begin(), host.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == ':' ||
           c == '_';
  });
}

// Reads YAML mappings with the file name at hand, so every error says where.
class Reader {
 public:
  explicit Reader(std::string file) : file_(std::move(file)) {}
  const std::string& file() const { return file_; }

  // OK when every key of `map` is in `allowed`; else names the first unknown one.
  Status CheckKeys(const YAML::Node& map, const std::string& where,
                   const std::vector<std::string>& allowed) const {
    if (!map.IsMap()) {
      return ErrorAt(file_, LineOf(map), "{} must be a mapping (key: value lines)", where);
    }
    for (const auto& entry : map) {
      const std::string key = entry.first.Scalar();
      if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
        return ErrorAt(file_, LineOf(entry.first), "unknown key '{}' in {}; the keys are: {}", key,
                       where, fmt::join(allowed, ", "));
      }
    }
    return Status::Ok();
  }

  Result<std::string> String(const YAML::Node& map, const std::string& key,
                             const std::string& where) const {
    const YAML::Node value = map[key];
    if (!value.IsScalar()) {
      return ErrorAt(file_, LineOf(value.IsDefined() ? value : map),
                     "{}.{} must be a single value (a string)", where, key);
    }
    return value.Scalar();
  }

  Result<int64_t> Integer(const YAML::Node& map, const std::string& key, const std::string& where,
                          int64_t min) const {
    const YAML::Node value = map[key];
    const std::string text = value.IsScalar() ? value.Scalar() : std::string();
    int64_t parsed = 0;
    auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), parsed);
    if (!value.IsScalar() || text.empty() || error != std::errc() ||
        end != text.data() + text.size()) {
      return ErrorAt(file_, LineOf(value), "{}.{} is '{}', not a whole number; write e.g. {}: {}",
                     where, key, text, key, std::max<int64_t>(min, 1));
    }
    if (parsed < min || parsed > (int64_t{1} << 40)) {
      return ErrorAt(file_, LineOf(value), "{}.{} is {}; it must be at least {}", where, key,
                     parsed, min);
    }
    return parsed;
  }

  Result<std::vector<std::string>> Strings(const YAML::Node& map, const std::string& key,
                                           const std::string& where) const {
    const YAML::Node value = map[key];
    if (!value.IsSequence()) {
      return ErrorAt(file_, LineOf(value), "{}.{} must be a list, e.g. {}: [\"...\"]", where, key,
                     key);
    }
    std::vector<std::string> out;
    for (const YAML::Node& item : value) {
      if (!item.IsScalar()) {
        return ErrorAt(file_, LineOf(item), "every item of {}.{} must be a string", where, key);
      }
      out.push_back(item.Scalar());
    }
    return out;
  }

  Result<EnvironmentMap> Environment(const YAML::Node& map, const std::string& key,
                                     const std::string& where) const {
    const YAML::Node value = map[key];
    if (!value.IsMap()) {
      return ErrorAt(file_, LineOf(value), "{}.{} must be a mapping of NAME: value", where, key);
    }
    EnvironmentMap env;
    for (const auto& entry : value) {
      const std::string name = entry.first.Scalar();
      const bool valid_name = !name.empty() && !std::isdigit(static_cast<unsigned char>(name[0])) &&
                              std::all_of(name.begin(), name.end(), [](char c) {
                                return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
                              });
      if (!valid_name) {
        return ErrorAt(file_, LineOf(entry.first),
                       "'{}' in {}.{} is not an environment variable name (letters, digits, _)",
                       name, where, key);
      }
      if (!entry.second.IsScalar()) {
        return ErrorAt(file_, LineOf(entry.second), "{}.{}.{} must be a single value", where, key,
                       name);
      }
      env[name] = entry.second.Scalar();
    }
    return env;
  }

 private:
  std::string file_;
};

Result<NodeSpec> ParseNode(const Reader& reader, const YAML::Node& node, size_t index) {
  const std::string where = fmt::format("nodes[{}]", index);
  TESSERA_RETURN_IF_ERROR(reader.CheckKeys(
      node, where, {"address", "workers", "gpus", "threads", "host_memory_mb", "user", "env"}));
  NodeSpec spec;
  spec.line = LineOf(node);
  if (!node["address"]) {
    return ErrorAt(reader.file(), spec.line, "{} has no address; add `address: <host or IP>`",
                   where);
  }
  TESSERA_ASSIGN_OR_RETURN(spec.address, reader.String(node, "address", where));
  if (!ValidHost(spec.address)) {
    return ErrorAt(reader.file(), LineOf(node["address"]),
                   "{}.address '{}' is not a host name or IP address", where, spec.address);
  }
  if (node["gpus"]) {
    TESSERA_ASSIGN_OR_RETURN(int64_t gpus, reader.Integer(node, "gpus", where, 0));
    spec.gpus = static_cast<int>(gpus);
    spec.workers = 0;  // gpus alone: no CPU workers unless asked
  }
  if (node["workers"]) {
    TESSERA_ASSIGN_OR_RETURN(int64_t workers, reader.Integer(node, "workers", where, 0));
    spec.workers = static_cast<int>(workers);
  }
  if (spec.workers == 0 && spec.gpus == 0) {
    return ErrorAt(reader.file(), spec.line,
                   "{} ({}) has no workers and no gpus; give it `workers: N` or `gpus: N`, or "
                   "remove it",
                   where, spec.address);
  }
  if (node["threads"]) {
    TESSERA_ASSIGN_OR_RETURN(int64_t threads, reader.Integer(node, "threads", where, 0));
    spec.threads = static_cast<int>(threads);
  }
  if (node["host_memory_mb"]) {
    TESSERA_ASSIGN_OR_RETURN(spec.host_memory_mb, reader.Integer(node, "host_memory_mb", where, 1));
  }
  if (node["user"]) {
    TESSERA_ASSIGN_OR_RETURN(spec.user, reader.String(node, "user", where));
  }
  if (node["env"]) {
    TESSERA_ASSIGN_OR_RETURN(spec.env, reader.Environment(node, "env", where));
  }
  return spec;
}

Status CheckDistinctNodes(const ClusterSpec& spec) {
  std::map<std::string, int> seen;
  for (const NodeSpec& node : spec.nodes) {
    auto [it, fresh] = seen.emplace(node.address, node.line);
    if (!fresh) {
      return ErrorAt(spec.file, node.line,
                     "node {} is listed twice (first at line {}); give it one entry with all its "
                     "workers",
                     node.address, it->second);
    }
  }
  return Status::Ok();
}

Result<ClusterSpec> ParseYamlRoot(const Reader& reader, const YAML::Node& root) {
  ClusterSpec spec;
  spec.file = reader.file();
  spec.name = StemOf(reader.file());
  if (!root.IsDefined() || root.IsNull()) {
    return ErrorAt(reader.file(), 1, "the file is empty; it needs at least head and nodes");
  }
  TESSERA_RETURN_IF_ERROR(
      reader.CheckKeys(root, "the cluster file",
                       {"cluster_name", "head", "nodes", "ssh", "setup_commands", "env",
                        "tessera_binary", "session_root", "join_timeout_s"}));
  if (root["cluster_name"]) {
    TESSERA_ASSIGN_OR_RETURN(spec.name, reader.String(root, "cluster_name", "the cluster file"));
    if (!ValidName(spec.name)) {
      return ErrorAt(reader.file(), LineOf(root["cluster_name"]),
                     "cluster_name '{}' may hold only letters, digits, '_', '.' and '-'",
                     spec.name);
    }
  } else if (!ValidName(spec.name)) {
    return ErrorAt(reader.file(), 1,
                   "the file name '{}' cannot name the cluster; add `cluster_name: <name>` "
                   "(letters, digits, '_', '.', '-')",
                   spec.name);
  }
  const YAML::Node head = root["head"];
  if (!head) {
    return ErrorAt(reader.file(), 1, "no head; add `head: {{address: <IP>, port: 6380}}`");
  }
  TESSERA_RETURN_IF_ERROR(reader.CheckKeys(head, "head", {"address", "port"}));
  if (!head["address"]) {
    return ErrorAt(reader.file(), LineOf(head), "head has no address; add `address: <IP>`");
  }
  TESSERA_ASSIGN_OR_RETURN(spec.head.address, reader.String(head, "address", "head"));
  if (!ValidHost(spec.head.address)) {
    return ErrorAt(reader.file(), LineOf(head["address"]),
                   "head.address '{}' is not a host name or IP address", spec.head.address);
  }
  if (head["port"]) {
    TESSERA_ASSIGN_OR_RETURN(int64_t port, reader.Integer(head, "port", "head", 1));
    if (port > 65535) {
      return ErrorAt(reader.file(), LineOf(head["port"]), "head.port {} is above 65535", port);
    }
    spec.head.port = static_cast<int>(port);
  }
  const YAML::Node nodes = root["nodes"];
  if (!nodes || !nodes.IsSequence() || nodes.size() == 0) {
    return ErrorAt(reader.file(), nodes ? LineOf(nodes) : 1,
                   "nodes must be a list of at least one node, e.g. `nodes: [{{address: <IP>, "
                   "workers: 2}}]`");
  }
  for (size_t i = 0; i < nodes.size(); ++i) {
    TESSERA_ASSIGN_OR_RETURN(NodeSpec node, ParseNode(reader, nodes[i], i));
    spec.nodes.push_back(std::move(node));
  }
  TESSERA_RETURN_IF_ERROR(CheckDistinctNodes(spec));
  if (const YAML::Node ssh = root["ssh"]) {
    TESSERA_RETURN_IF_ERROR(
        reader.CheckKeys(ssh, "ssh", {"user", "key", "port", "connect_timeout_s", "options"}));
    if (ssh["user"]) {
      TESSERA_ASSIGN_OR_RETURN(spec.ssh.user, reader.String(ssh, "user", "ssh"));
    }
    if (ssh["key"]) {
      TESSERA_ASSIGN_OR_RETURN(spec.ssh.key, reader.String(ssh, "key", "ssh"));
    }
    if (ssh["port"]) {
      TESSERA_ASSIGN_OR_RETURN(int64_t port, reader.Integer(ssh, "port", "ssh", 1));
      spec.ssh.port = static_cast<int>(port);
    }
    if (ssh["connect_timeout_s"]) {
      TESSERA_ASSIGN_OR_RETURN(int64_t seconds, reader.Integer(ssh, "connect_timeout_s", "ssh", 1));
      spec.ssh.connect_timeout_s = static_cast<int>(seconds);
    }
    if (ssh["options"]) {
      TESSERA_ASSIGN_OR_RETURN(spec.ssh.options, reader.Strings(ssh, "options", "ssh"));
    }
  }
  const std::string top = "the cluster file";
  if (root["setup_commands"]) {
    TESSERA_ASSIGN_OR_RETURN(spec.setup_commands, reader.Strings(root, "setup_commands", top));
  }
  if (root["env"]) {
    TESSERA_ASSIGN_OR_RETURN(spec.env, reader.Environment(root, "env", top));
  }
  if (root["tessera_binary"]) {
    TESSERA_ASSIGN_OR_RETURN(spec.tessera_binary, reader.String(root, "tessera_binary", top));
  }
  if (root["session_root"]) {
    TESSERA_ASSIGN_OR_RETURN(spec.session_root, reader.String(root, "session_root", top));
  }
  if (root["join_timeout_s"]) {
    TESSERA_ASSIGN_OR_RETURN(int64_t seconds, reader.Integer(root, "join_timeout_s", top, 1));
    spec.join_timeout_s = static_cast<int>(seconds);
  }
  return spec;
}

}  // namespace

int ClusterSpec::ExpectedWorkers() const {
  int total = 0;
  for (const NodeSpec& node : nodes) total += node.workers + node.gpus;
  return total;
}

std::string ClusterSpec::HeadSessionDir() const { return session_root + "/" + name + "-head"; }

std::string ClusterSpec::NodeSessionDir(const NodeSpec& node) const {
  return session_root + "/" + name + "-node-" + node.address;
}

Result<ClusterSpec> ParseClusterYaml(std::string_view text, const std::string& file) {
  const Reader reader(file);
  // yaml-cpp reports by exceptions; none leaves this function.
  try {
    return ParseYamlRoot(reader, YAML::Load(std::string(text)));
  } catch (const YAML::Exception& e) {
    return ErrorAt(file, e.mark.line + 1, "not valid YAML: {}", e.msg);
  }
}

Result<ClusterSpec> ParseHostfile(std::string_view text, const std::string& file) {
  ClusterSpec spec;
  spec.file = file;
  spec.name = StemOf(file);
  if (!ValidName(spec.name)) spec.name = "hostfile";
  std::istringstream lines{std::string(text)};
  std::string line;
  for (int number = 1; std::getline(lines, line); ++number) {
    if (const size_t hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream words(line);
    std::string host;
    if (!(words >> host)) continue;  // blank or comment
    NodeSpec node;
    node.address = host;
    node.line = number;
    if (!ValidHost(host)) {
      return ErrorAt(file, number, "'{}' is not a host name or IP address", host);
    }
    for (std::string word; words >> word;) {
      constexpr std::string_view kSlots = "slots=";
      if (!word.starts_with(kSlots)) {
        return ErrorAt(file, number, "unknown field '{}'; a line is `host slots=N`", word);
      }
      const std::string_view value = std::string_view(word).substr(kSlots.size());
      int slots = 0;
      auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), slots);
      if (value.empty() || error != std::errc() || end != value.data() + value.size() ||
          slots < 1) {
        return ErrorAt(file, number, "slots '{}' is not a positive whole number; write slots=N",
                       value);
      }
      node.workers = slots;
    }
    spec.nodes.push_back(std::move(node));
  }
  if (spec.nodes.empty()) {
    return ErrorAt(file, 1, "no hosts; write one `host slots=N` line per node");
  }
  TESSERA_RETURN_IF_ERROR(CheckDistinctNodes(spec));
  spec.head.address = spec.nodes.front().address;
  return spec;
}

Result<ClusterSpec> LoadClusterFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound("cannot read the cluster file '{}'", path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string extension = std::filesystem::path(path).extension().string();
  if (extension == ".yaml" || extension == ".yml") return ParseClusterYaml(text.str(), path);
  return ParseHostfile(text.str(), path);
}

}  // namespace tessera::launcher
