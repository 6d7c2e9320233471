// A test plugin (plugin_test) defining an op that examples/plugin's my_ops defines too.
#include <vector>

#include "ops/plugin.h"

namespace {

tessera::Status AddOps(tessera::OpRegistry& registry) {
  return registry.AddOp(
      tessera::OpDef{.name = "softsign_forward",
                     .input_names = {"x"},
                     .output_names = {"out"},
                     .infer = [](const std::vector<tessera::TensorMeta>& in, const tessera::Attrs&)
                         -> tessera::Result<std::vector<tessera::TensorMeta>> { return in; },
                     .cost = [](const std::vector<tessera::TensorMeta>&,
                                const tessera::Attrs&) { return tessera::OpCost{}; }});
}

}  // namespace

TESSERA_PLUGIN("clashing_ops", AddOps, nullptr)
