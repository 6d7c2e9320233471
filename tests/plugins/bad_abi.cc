// A test plugin (plugin_test) that claims a plugin ABI version no Tessera speaks.
#include "ops/plugin.h"

extern "C" __attribute__((visibility("default"))) const tessera::PluginInfo* tessera_plugin_info() {
  static const tessera::PluginInfo info{
      tessera::kPluginMagic, 999, 0, "from_the_future", "9.9.9", nullptr, nullptr};
  return &info;
}
