#include "ops/plugin.h"

#include <dlfcn.h>

#include <deque>
#include <memory>
#include <system_error>
#include <utility>

#include "core/atomic_file.h"
#include "core/crypto.h"
#include "core/thread_annotations.h"
#include "core/version.h"

namespace tessera {

namespace {

// Every plugin of the process. A deque: LoadedPlugin pointers handed out stay valid.
struct PluginSet {
  Mutex mutex;
  std::deque<LoadedPlugin> plugins GUARDED_BY(mutex);
};

PluginSet& Plugins() {
  static PluginSet* set = new PluginSet;  // never destroyed: plugins are never unloaded
  return *set;
}

// A file name part from a plugin's name: letters, digits, '-', '_' and '.' kept, others '_'.
std::string FileSafe(std::string_view name) {
  std::string safe(name.substr(0, 64));
  for (char& c : safe) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_' || c == '.';
    if (!ok) c = '_';
  }
  return safe.empty() ? std::string("plugin") : safe;
}

// The plugin of the set loaded with `sha256`; null when none is.
const LoadedPlugin* FindBySha256(const PluginSet& set, std::string_view sha256)
    REQUIRES(set.mutex) {
  for (const LoadedPlugin& loaded : set.plugins) {
    if (loaded.sha256 == sha256) return &loaded;
  }
  return nullptr;
}

// A plugin's ops, then its kernels for `device`, added to `registry`; errors name the plugin.
Status AddOpsOf(const LoadedPlugin& plugin, OpRegistry& registry) {
  return plugin.info->add_ops(registry).WithContext(
      fmt::format("plugin '{}' ({}) adding its ops", plugin.name, plugin.path));
}
Status AddKernelsOf(const LoadedPlugin& plugin, OpRegistry& registry, DeviceKind device) {
  if (plugin.info->add_kernels == nullptr) return Status::Ok();
  return plugin.info->add_kernels(registry, device)
      .WithContext(fmt::format("plugin '{}' ({}) adding its {} kernels", plugin.name, plugin.path,
                               DeviceKindName(device)));
}

// dlopens `path` (holding `bytes`, whose digest is `sha256`) and checks its entry point. Runs
// under the set's lock, so one library is never loaded twice at once.
Result<const LoadedPlugin*> Load(PluginSet& set, const std::filesystem::path& path,
                                 std::string bytes, std::string sha256) REQUIRES(set.mutex) {
  if (const LoadedPlugin* loaded = FindBySha256(set, sha256)) return loaded;
  // RTLD_NOW: a symbol the process lacks is reported here, not as a crash in a kernel later.
  // RTLD_LOCAL: two plugins' own symbols never resolve against each other.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* reason = dlerror();
    return InvalidArgument(
        "cannot load plugin {}: {} (a plugin is a shared library built against Tessera's SDK "
        "with tessera_add_plugin; an undefined symbol means it needs a Tessera function this "
        "program does not have, e.g. one built from a newer SDK)",
        path.string(), reason != nullptr ? reason : "unknown error");
  }
  using EntryPoint = const PluginInfo* (*)();
  auto entry = reinterpret_cast<EntryPoint>(dlsym(handle, kPluginEntryPoint));
  if (entry == nullptr) {
    dlclose(handle);
    return InvalidArgument(
        "{} is not a Tessera plugin: it has no {} (define it with TESSERA_PLUGIN(name, add_ops, "
        "add_kernels) from ops/plugin.h)",
        path.string(), kPluginEntryPoint);
  }
  const PluginInfo* info = entry();
  if (info == nullptr || info->magic != kPluginMagic) {
    dlclose(handle);
    return InvalidArgument("{} is not a Tessera plugin: its {} does not return a PluginInfo",
                           path.string(), kPluginEntryPoint);
  }
  // Only magic and abi_version are read before the version is known to match; what a message
  // needs is copied before the library goes.
  if (info->abi_version != kPluginAbiVersion) {
    const uint32_t theirs = info->abi_version;
    dlclose(handle);
    return Infeasible(
        "plugin {} speaks plugin ABI version {}, this program (Tessera {}) version {}: rebuild "
        "the plugin against this Tessera's SDK (cmake --install of the same build)",
        path.string(), theirs, TesseraVersion(), kPluginAbiVersion);
  }
  if (info->layout != PluginLayout()) {
    const uint64_t theirs = info->layout;
    const std::string name = info->name != nullptr ? info->name : "?";
    const std::string built = info->tessera_version != nullptr ? info->tessera_version : "?";
    dlclose(handle);
    return Infeasible(
        "plugin {} ('{}', built against Tessera {}) was compiled with other type layouts than "
        "this program (Tessera {}: layout {:016x}, the plugin's {:016x}; another compiler, "
        "standard library ABI or SDK): rebuild it against this Tessera's SDK with the same "
        "compiler",
        path.string(), name, built, TesseraVersion(), PluginLayout(), theirs);
  }
  if (info->name == nullptr || *info->name == '\0' || info->add_ops == nullptr) {
    dlclose(handle);
    return InvalidArgument("plugin {} has no name or no add_ops function", path.string());
  }
  for (const LoadedPlugin& loaded : set.plugins) {
    if (loaded.name == info->name) {
      // Not dlclosed: the handle is the other build's only if dlopen saw the same file.
      return AlreadyExists(
          "plugin '{}' from {} (sha256 {}) is another build of the plugin '{}' this process "
          "loaded from {} (sha256 {}): a process keeps the ops of the first; start new "
          "processes (tessera down and up) to use the new build",
          info->name, path.string(), sha256.substr(0, 12), loaded.name, loaded.path,
          loaded.sha256.substr(0, 12));
    }
  }
  LoadedPlugin& plugin = set.plugins.emplace_back();
  plugin.name = info->name;
  plugin.path = path.string();
  plugin.sha256 = std::move(sha256);
  plugin.library = std::move(bytes);
  plugin.tessera_version = info->tessera_version != nullptr ? info->tessera_version : "unknown";
  plugin.info = info;
  return &plugin;
}

}  // namespace

Result<const LoadedPlugin*> LoadPlugin(const std::filesystem::path& path) {
  std::error_code error;
  if (!std::filesystem::exists(path, error)) {
    return NotFound("plugin {} does not exist{}", path.string(),
                    path.is_absolute() ? "" : " (relative to the current directory)");
  }
  TESSERA_ASSIGN_OR_RETURN(std::string bytes, ReadWholeFile(path.string(), "plugin"));
  std::string sha256 = Sha256Hex(bytes);
  PluginSet& set = Plugins();
  MutexLock lock(&set.mutex);
  // The absolute path: what the messages name, whatever the current directory becomes (and
  // dlopen never searches the library path for it).
  std::filesystem::path absolute = std::filesystem::absolute(path, error);
  if (error) absolute = path;
  return Load(set, absolute, std::move(bytes), std::move(sha256));
}

Result<const LoadedPlugin*> LoadPluginBytes(std::string_view name, std::string_view sha256,
                                            std::string bytes, const std::filesystem::path& dir) {
  std::string digest = Sha256Hex(bytes);
  if (digest != sha256) {
    return InvalidArgument("plugin '{}': its bytes have sha256 {}, not the {} they were sent as",
                           name, digest, sha256);
  }
  PluginSet& set = Plugins();
  MutexLock lock(&set.mutex);
  if (const LoadedPlugin* loaded = FindBySha256(set, digest)) return loaded;
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    return Unavailable("cannot create the plugin directory {}: {}", dir.string(), error.message());
  }
  // Named by content: a file of that name holds these bytes (written atomically), so a second
  // process of the session loads the same file.
  const std::filesystem::path path =
      dir / fmt::format("{}-{}.so", digest.substr(0, 16), FileSafe(name));
  // A file left there holds these bytes unless it was damaged: then it is written again.
  Result<std::string> there = ReadWholeFile(path.string(), "plugin");
  if (!there.ok() || Sha256Hex(*there) != digest) {
    TESSERA_RETURN_IF_ERROR(WriteFileAtomically(path.string(), bytes, 0700));
  }
  return Load(set, path, std::move(bytes), std::move(digest));
}

const LoadedPlugin* FindLoadedPlugin(std::string_view sha256) {
  PluginSet& set = Plugins();
  MutexLock lock(&set.mutex);
  return FindBySha256(set, sha256);
}

std::vector<const LoadedPlugin*> LoadedPlugins() {
  PluginSet& set = Plugins();
  MutexLock lock(&set.mutex);
  std::vector<const LoadedPlugin*> plugins;
  plugins.reserve(set.plugins.size());
  for (const LoadedPlugin& loaded : set.plugins) plugins.push_back(&loaded);
  return plugins;
}

Status AddLoadedPluginOps(OpRegistry& registry) {
  for (const LoadedPlugin* plugin : LoadedPlugins()) {
    TESSERA_RETURN_IF_ERROR(AddOpsOf(*plugin, registry));
  }
  return Status::Ok();
}

Status AddLoadedPluginKernels(OpRegistry& registry, DeviceKind device) {
  for (const LoadedPlugin* plugin : LoadedPlugins()) {
    TESSERA_RETURN_IF_ERROR(AddKernelsOf(*plugin, registry, device));
  }
  return Status::Ok();
}

Status AddPluginTo(const LoadedPlugin& plugin, OpRegistry& registry,
                   const std::vector<DeviceKind>& devices) {
  TESSERA_RETURN_IF_ERROR(AddOpsOf(plugin, registry));
  for (DeviceKind device : devices) TESSERA_RETURN_IF_ERROR(AddKernelsOf(plugin, registry, device));
  return Status::Ok();
}

}  // namespace tessera
