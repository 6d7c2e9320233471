// Another build of the plugin "my_ops" (other bytes, the same name), for plugin_test: a process
// that loaded examples/plugin's refuses it.
#include "ops/plugin.h"

namespace {

tessera::Status AddOps(tessera::OpRegistry&) { return tessera::Status::Ok(); }

}  // namespace

TESSERA_PLUGIN("my_ops", AddOps, nullptr)
