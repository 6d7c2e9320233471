// A test plugin (plugin_test) that needs a function the loading process does not have: dlopen's
// RTLD_NOW reports it when the plugin loads, not as a crash later.
#include "ops/plugin.h"

extern "C" int tessera_function_nobody_defines();

namespace {

tessera::Status AddOps(tessera::OpRegistry&) {
  return tessera_function_nobody_defines() == 0 ? tessera::Status::Ok()
                                                : tessera::Internal("unreachable");
}

}  // namespace

TESSERA_PLUGIN("missing_symbol", AddOps, nullptr)
