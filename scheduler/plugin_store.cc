#include "scheduler/plugin_store.h"

#include <algorithm>
#include <string_view>

#include "core/crypto.h"
#include "core/logging.h"

namespace tessera {

namespace {

std::string_view View(capnp::Text::Reader text) { return {text.begin(), text.size()}; }

bool IsSha256Hex(std::string_view text) {
  return text.size() == 64 && std::all_of(text.begin(), text.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

// The refusals kept to answer graphs with; past it the oldest reasons are forgotten (the graph
// then hears NotFound).
constexpr size_t kMaxRefusals = 1024;

}  // namespace

Status PluginStore::Add(WorkerId driver, proto::Plugin::Reader plugin) {
  const std::string_view name = View(plugin.getName());
  const std::string sha256(View(plugin.getSha256()));
  if (!IsSha256Hex(sha256)) {
    return InvalidArgument("LoadPlugin '{}': sha256 '{}' is not 64 lowercase hex digits", name,
                           sha256);
  }
  const auto library = plugin.getLibrary();
  const std::string_view bytes(reinterpret_cast<const char*>(library.begin()), library.size());
  if (Sha256Hex(bytes) != sha256) {
    return InvalidArgument("LoadPlugin '{}': the library's sha256 is not the {} it was sent as",
                           name, sha256);
  }
  if (libraries_.contains(sha256)) return Status::Ok();
  auto refuse = [&](Status reason) {
    GetLogger("scheduler")
        ->warn("driver {}: plugin '{}' refused: {}", driver.value(), name, reason.ToString());
    if (refused_.size() >= kMaxRefusals) refused_.erase(refused_.begin());
    refused_[sha256] = std::move(reason);
    return Status::Ok();
  };
  if (!allowed_) {
    return refuse(Infeasible(
        "this cluster refuses plugins: its scheduler runs with TESSERA_ALLOW_PLUGINS=0 (start it "
        "without that setting to load plugins, or train without --plugin)"));
  }
  if (libraries_.size() >= kMaxPlugins || bytes_ + static_cast<int64_t>(bytes.size()) > kMaxBytes) {
    return refuse(ResourceExhausted(
        "the scheduler holds {} plugins ({} MiB) already, its most: restart the cluster "
        "(tessera down and up) to clear them",
        libraries_.size(), bytes_ >> 20));
  }
  refused_.erase(sha256);
  bytes_ += static_cast<int64_t>(bytes.size());
  libraries_.emplace(sha256, std::string(bytes));
  GetLogger("scheduler")
      ->info("driver {} sent plugin '{}' ({} KiB, sha256 {})", driver.value(), name,
             bytes.size() >> 10, sha256.substr(0, 12));
  return Status::Ok();
}

Result<std::vector<PluginRef>> PluginStore::Check(
    uint64_t graph_id, capnp::List<proto::Plugin>::Reader plugins) const {
  std::vector<PluginRef> refs;
  for (proto::Plugin::Reader plugin : plugins) {
    PluginRef ref{std::string(View(plugin.getName())), std::string(View(plugin.getSha256()))};
    if (!libraries_.contains(ref.sha256)) {
      if (auto refused = refused_.find(ref.sha256); refused != refused_.end()) {
        return refused->second.WithContext(
            fmt::format("graph {} needs plugin '{}'", graph_id, ref.name));
      }
      return NotFound(
          "graph {} needs plugin '{}' (sha256 {}), which was not sent to the scheduler before it "
          "(a driver sends each plugin's library before the first graph naming it)",
          graph_id, ref.name, ref.sha256);
    }
    refs.push_back(std::move(ref));
  }
  return refs;
}

void PluginStore::SendTo(WorkerId worker, std::span<const PluginRef> plugins) {
  std::set<std::string>& sent = sent_[worker];
  for (const PluginRef& plugin : plugins) {
    auto held = libraries_.find(plugin.sha256);
    if (held == libraries_.end() || !sent.insert(plugin.sha256).second) continue;
    SendLoadPlugin(*outbox_, worker, plugin, held->second);
  }
}

}  // namespace tessera
