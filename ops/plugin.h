// Plugins: a user's own ops and kernels, in a shared library that a driver names and every process
// of the cluster loads, so that adding an op needs no rebuild of Tessera.
//
// A plugin is built against the installed SDK (examples/plugin/: `tessera_add_plugin`) and says
// what it adds with one macro:
//
//   tessera::Status AddMyOps(tessera::OpRegistry& registry);              // OpDefs
//   tessera::Status AddMyKernels(tessera::OpRegistry& registry,           // kernels, per device
//                                tessera::DeviceKind device);             // kind the process has
//   TESSERA_PLUGIN("my_ops", AddMyOps, AddMyKernels)
//
// The driver loads it (LoadPlugin, or `--plugin PATH` on the example drivers) before it builds a
// model: from then on every registry the process makes holds the plugin's ops (RegisterStandardOps)
// and its CPU kernels (RegisterCpuKernels). Every graph the driver registers with a cluster names
// the plugins of the driver's process; the driver sends each plugin's bytes once, the scheduler
// sends them to each worker that receives a part of such a graph, and the worker writes them under
// its session root (<root>/plugins/, by digest) and loads them too (LoadPluginBytes, then
// AddPluginTo its registry), so the library need not exist on the workers' hosts. A worker runs a
// graph's part only with every plugin the graph names loaded, by content (SHA-256): never an older
// build of the same ops.
//
// The ABI: the library and the process must agree on the layout of every type that crosses
// between them (OpDef, Tensor, Status, std::string, std::function, ...). kPluginAbiVersion is
// raised whenever Tessera changes one of them; PluginLayout() is a fingerprint of their sizes and
// of the C++ library's ABI, compiled into both sides. A plugin whose magic, ABI version or layout
// differs is refused with both sides' versions and the fix (rebuild the plugin against this
// Tessera's SDK), before any of its code runs. Undefined symbols of the plugin (Tessera's
// functions, e.g. OpRegistry::AddOp) are resolved from the loading process, which exports them
// (the `tessera` binary and every program linking Tessera::tessera: -rdynamic); the plugin links
// no Tessera library itself.
//
// Plugins are never unloaded: a process keeps every plugin it loaded until it exits. Two plugins
// (or two builds of one) defining the same op are refused with AlreadyExists naming the op and both
// plugins; a new build of a plugin needs new workers (`tessera down` and `up`).
//
// Security: loading a plugin runs its code. A cluster's token is therefore also the right to run
// native code on every worker; a scheduler started with TESSERA_ALLOW_PLUGINS=0 refuses them.
//
// Thread safety: every function is thread-safe (the set of loaded plugins has its own lock;
// registries theirs).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/attrs.h"
#include "core/device.h"
#include "core/status.h"
#include "core/tensor.h"
#include "ops/op_registry.h"

namespace tessera {

// "TSPL": the first field of every PluginInfo, of every version.
inline constexpr uint32_t kPluginMagic = 0x5453504c;
// Raised with every change to a type that crosses between a plugin and Tessera.
inline constexpr uint32_t kPluginAbiVersion = 1;

// A fingerprint of the layouts a plugin shares with the process (FNV-1a over the sizes and
// alignments of the types in OpDef's and KernelFn's signatures, and libstdc++'s string ABI).
constexpr uint64_t PluginLayout() {
  const uint64_t parts[] = {
    sizeof(OpDef),
    alignof(OpDef),
    sizeof(Tensor),
    sizeof(TensorMeta),
    sizeof(Attrs),
    sizeof(Status),
    sizeof(KernelContext),
    sizeof(GradientRule),
    sizeof(std::string),
    sizeof(KernelFn),
    sizeof(InferFn),
    sizeof(Shape),
    sizeof(Device),
    sizeof(DType),
    sizeof(DeviceKind),
    kPluginAbiVersion,
#if defined(_GLIBCXX_USE_CXX11_ABI)
    _GLIBCXX_USE_CXX11_ABI + 2,
#else
    1,
#endif
  };
  uint64_t hash = 14695981039346656037ull;
  for (uint64_t part : parts) {
    hash ^= part;
    hash *= 1099511628211ull;
  }
  return hash;
}

// What a plugin's `tessera_plugin_info()` returns (TESSERA_PLUGIN defines it). `magic` and
// `abi_version` come first in every version, so a loader reads them from any plugin.
struct PluginInfo {
  uint32_t magic;
  uint32_t abi_version;
  uint64_t layout;              // PluginLayout() where the plugin was compiled
  const char* name;             // e.g. "my_ops"
  const char* tessera_version;  // the SDK's version it was built against
  Status (*add_ops)(OpRegistry& registry);
  // Called for each device kind the loading process runs kernels on (kCpu; kCuda on a GPU
  // worker). A plugin without kernels for a kind adds none: its ops then run only elsewhere.
  Status (*add_kernels)(OpRegistry& registry, DeviceKind device);
};

// The symbol every plugin exports.
inline constexpr const char* kPluginEntryPoint = "tessera_plugin_info";

// Defines the plugin's entry point. `name`: a string literal; `add_ops`, `add_kernels`: functions
// as in PluginInfo (add_kernels may be nullptr for a plugin of op definitions only).
#define TESSERA_PLUGIN(name, add_ops, add_kernels)                               \
  extern "C" __attribute__((visibility("default"))) const ::tessera::PluginInfo* \
  tessera_plugin_info() {                                                        \
    static const ::tessera::PluginInfo info{::tessera::kPluginMagic,             \
                                            ::tessera::kPluginAbiVersion,        \
                                            ::tessera::PluginLayout(),           \
                                            name,                                \
                                            TESSERA_PLUGIN_SDK_VERSION,          \
                                            add_ops,                             \
                                            add_kernels};                        \
    return &info;                                                                \
  }

// The SDK version a plugin records; the build (CMake) defines it, "unknown" otherwise.
#ifndef TESSERA_PLUGIN_SDK_VERSION
#define TESSERA_PLUGIN_SDK_VERSION "unknown"
#endif

// A plugin loaded into this process.
struct LoadedPlugin {
  std::string name;             // its PluginInfo's
  std::string path;             // the file it was loaded from
  std::string sha256;           // of the file's bytes, hex: what graphs name it by
  std::string library;          // the file's bytes (what the driver sends to the cluster)
  std::string tessera_version;  // the SDK it was built against
  const PluginInfo* info = nullptr;
};

// Loads the plugin at `path` into this process (once: the same bytes loaded again return the same
// plugin). Errors: NotFound naming the path (no such file); InvalidArgument for a file that is not
// a loadable shared library (dlopen's reason, e.g. an undefined symbol the process lacks) or that
// has no tessera_plugin_info; Infeasible for another ABI version or layout (naming both
// sides and the fix); AlreadyExists for a second plugin of the same name with other bytes.
Result<const LoadedPlugin*> LoadPlugin(const std::filesystem::path& path);

// Loads a plugin received as bytes (a worker's): written atomically to `dir`/<sha256>-<name>.so
// (kept if there already) and loaded from there. `sha256` must be the bytes' (InvalidArgument
// otherwise); errors otherwise as LoadPlugin's.
Result<const LoadedPlugin*> LoadPluginBytes(std::string_view name, std::string_view sha256,
                                            std::string bytes, const std::filesystem::path& dir);

// The plugin loaded with `sha256`; null when none is.
const LoadedPlugin* FindLoadedPlugin(std::string_view sha256);

// Every plugin this process loaded, in load order.
std::vector<const LoadedPlugin*> LoadedPlugins();

// Adds every loaded plugin's ops to `registry` (RegisterStandardOps calls it last).
Status AddLoadedPluginOps(OpRegistry& registry);
// Adds every loaded plugin's kernels for `device` (RegisterCpuKernels calls it for kCpu, the GPU
// worker's AddGpuKernels for kCuda).
Status AddLoadedPluginKernels(OpRegistry& registry, DeviceKind device);

// Adds one plugin's ops, then its kernels for each of `devices`, to `registry` (a worker's, when
// the plugin arrives after the registry was made). Errors name the plugin.
Status AddPluginTo(const LoadedPlugin& plugin, OpRegistry& registry,
                   const std::vector<DeviceKind>& devices);

}  // namespace tessera
