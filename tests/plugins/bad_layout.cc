// A test plugin (plugin_test) built, as it claims, with other type layouts than this Tessera.
#include "ops/plugin.h"

extern "C" __attribute__((visibility("default"))) const tessera::PluginInfo* tessera_plugin_info() {
  static const tessera::PluginInfo info{tessera::kPluginMagic,
                                        tessera::kPluginAbiVersion,
                                        tessera::PluginLayout() ^ 1,
                                        "other_compiler",
                                        "0.0.1",
                                        [](tessera::OpRegistry&) { return tessera::Status::Ok(); },
                                        nullptr};
  return &info;
}
