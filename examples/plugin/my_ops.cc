// my_ops: a plugin (ops/plugin.h) adding one op to Tessera without rebuilding it: softsign,
// out = x / (1 + |x|), with its gradient dx = dout / (1 + |x|)^2, and CPU kernels for both.
//
// Built against the installed SDK (CMakeLists.txt: tessera_add_plugin), loaded by a driver:
//
//   train_mlp --plugin libmy_ops.so --activation softsign_forward
//
// which trains its MLP with softsign between the layers on a local cluster whose workers load
// this library too (sent by the driver). tests/unit/plugin_test.cc checks the kernels against
// the formula and a finite difference.
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops/op_def_util.h"
#include "ops/plugin.h"

namespace {

using tessera::Attrs;
using tessera::DeviceKind;
using tessera::DType;
using tessera::KernelContext;
using tessera::OpCost;
using tessera::OpDef;
using tessera::OpRegistry;
using tessera::Result;
using tessera::Status;
using tessera::Tensor;
using tessera::TensorMeta;
using Metas = std::vector<TensorMeta>;

// Every input f32 and of the first one's shape; the output is that too.
Result<Metas> SameAsX(const Metas& inputs, const Attrs&) {
  for (const TensorMeta& input : inputs) {
    TESSERA_RETURN_IF_ERROR(tessera::op_def::CheckDType("x", input, DType::kF32));
    if (input.shape != inputs[0].shape) {
      return tessera::InvalidArgument("softsign: inputs of shapes {} and {} differ",
                                      inputs[0].shape.ToString(), input.shape.ToString());
    }
  }
  return Metas{inputs[0]};
}

// `flops` per element; every input read and the output written once.
tessera::CostFn Elementwise(double flops) {
  return [flops](const Metas& inputs, const Attrs&) {
    const double bytes = tessera::op_def::Bytes(inputs) + static_cast<double>(inputs[0].bytes());
    return OpCost{flops * static_cast<double>(inputs[0].numel()), bytes};
  };
}

Status AddOps(OpRegistry& registry) {
  using tessera::op_def::In;
  using tessera::op_def::OutGrad;
  using tessera::op_def::Rule;
  TESSERA_RETURN_IF_ERROR(
      registry.AddOp(OpDef{.name = "softsign_forward",
                           .doc = "softsign: x / (1 + |x|) (the my_ops plugin)",
                           .input_names = {"x"},
                           .output_names = {"out"},
                           .infer = SameAsX,
                           .cost = Elementwise(3),
                           .gradient = Rule("softsign_backward", {OutGrad(0), In(0)}, {0})}));
  return registry.AddOp(OpDef{.name = "softsign_backward",
                              .doc = "softsign's gradient: dout / (1 + |x|)^2",
                              .input_names = {"dout", "x"},
                              .output_names = {"dx"},
                              .infer = SameAsX,
                              .cost = Elementwise(4)});
}

Status AddKernels(OpRegistry& registry, DeviceKind device) {
  if (device != DeviceKind::kCpu) return Status::Ok();  // CPU kernels only
  TESSERA_RETURN_IF_ERROR(registry.AddKernel("softsign_forward", DeviceKind::kCpu,
                                             [](const KernelContext&, const std::vector<Tensor>& in,
                                                const std::vector<Tensor>& out, const Attrs&) {
                                               const float* x = in[0].data<float>();
                                               float* y = out[0].data<float>();
                                               for (int64_t i = 0; i < in[0].numel(); ++i)
                                                 y[i] = x[i] / (1.0f + std::fabs(x[i]));
                                               return Status::Ok();
                                             }));
  return registry.AddKernel("softsign_backward", DeviceKind::kCpu,
                            [](const KernelContext&, const std::vector<Tensor>& in,
                               const std::vector<Tensor>& out, const Attrs&) {
                              const float* dout = in[0].data<float>();
                              const float* x = in[1].data<float>();
                              float* dx = out[0].data<float>();
                              for (int64_t i = 0; i < in[0].numel(); ++i) {
                                const float d = 1.0f + std::fabs(x[i]);
                                dx[i] = dout[i] / (d * d);
                              }
                              return Status::Ok();
                            });
}

}  // namespace

TESSERA_PLUGIN("my_ops", AddOps, AddKernels)
