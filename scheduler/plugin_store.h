// PluginStore: the plugins drivers sent (ops/plugin.h), kept by content until the scheduler ends,
// and which worker was sent which.
//
// A driver sends a plugin's library once (LoadPlugin) before the first graph naming it; the
// scheduler checks that the bytes are what their SHA-256 says, keeps them, and sends them to a
// worker before the first part of a graph naming them that the worker receives (SendTo). A
// registered graph may name only plugins the scheduler holds (Check).
//
// Bounds: at most kMaxPlugins plugins and kMaxBytes of libraries in all; past them a new plugin is
// refused with ResourceExhausted (the driver hears it when its graph names the plugin). A cluster
// whose scheduler was started with allow_plugins off refuses every plugin, naming the setting.
//
// Thread safety: none; the scheduler's io thread drives it.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "core/ids.h"
#include "core/proto/tessera.capnp.h"
#include "core/status.h"
#include "scheduler/messages.h"
#include "scheduler/outbox.h"

namespace tessera {

class PluginStore {
 public:
  static constexpr size_t kMaxPlugins = 256;
  static constexpr int64_t kMaxBytes = int64_t{1} << 30;

  PluginStore(Outbox* outbox, bool allowed) : outbox_(outbox), allowed_(allowed) {}

  // A driver's LoadPlugin. InvalidArgument (a protocol violation: the sender is disconnected) for a
  // sha256 that is not 64 lowercase hex digits, or bytes whose digest is another. A plugin that is
  // refused (plugins not allowed, a bound reached) is not kept: the graphs naming it are refused
  // with the reason (Check).
  Status Add(WorkerId driver, proto::Plugin::Reader plugin);

  // The plugins a RegisterGraph names, checked: each must be held (else the reason it was
  // refused, or NotFound: it was never sent).
  Result<std::vector<PluginRef>> Check(uint64_t graph_id,
                                       capnp::List<proto::Plugin>::Reader plugins) const;

  // Sends each of `plugins` that `worker` was not sent yet to it (LoadPlugin, with the library).
  void SendTo(WorkerId worker, std::span<const PluginRef> plugins);

  // `worker` is gone: forget what it was sent.
  void WorkerDied(WorkerId worker) { sent_.erase(worker); }

 private:
  Outbox* outbox_;
  bool allowed_;
  std::map<std::string, std::string> libraries_;    // by sha256
  std::map<std::string, Status> refused_;           // by sha256: why it was not kept (bounded)
  std::map<WorkerId, std::set<std::string>> sent_;  // shas each worker was sent
  int64_t bytes_ = 0;
};

}  // namespace tessera
