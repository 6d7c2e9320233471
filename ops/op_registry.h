// The op registry: op name -> shape inference, cost, and one kernel per device kind.
//
// An op is defined once (OpDef: its named inputs and outputs, shape inference, FLOP/byte cost,
// in-place pairs) and gets kernels per device separately, so what an op *is* (all a planner or
// the scheduler needs) is apart from how it runs (what a worker needs). Capability
// (Supports(op, device)) is separate from dispatch (FindKernel).
//
// In-place pairs: an op may declare that output j starts as a copy of input i and is updated
// in place (AdamW's parameter, the embedding gradient that accumulates the tied classifier's
// part). The executor guarantees that when a kernel starts, output j holds input i's contents:
// either it *is* input i's buffer (donated, when the task is that input's last user) or a
// copy. Kernels therefore read and write such data through the output only.
//
// The registry is built explicitly at start-up (RegisterStandardOps, then e.g.
// RegisterCpuKernels). A worker may add a plugin's ops and kernels later (ops/plugin.h) while
// its tasks look theirs up: every member is thread-safe (lookups share a lock, additions take it
// alone), and what Find and FindKernel return stays valid as long as the registry (nothing is
// ever removed).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/allocator.h"
#include "core/attrs.h"
#include "core/device.h"
#include "core/device_runtime.h"
#include "core/status.h"
#include "core/tensor.h"
#include "core/thread_annotations.h"

namespace tessera {

struct OpCost {
  double flops = 0;  // floating-point operations (a multiply-add counts 2)
  double bytes = 0;  // bytes read and written by the kernel, at least once each
};
// One number for a cost, as the planner weighs layers and tasks: the time on a machine doing 10
// flops per byte moved (only ratios of it mean anything).
inline double CostUnits(const OpCost& cost) { return cost.flops + 10 * cost.bytes; }

class OpRegistry;

// What a kernel gets besides its tensors.
struct KernelContext {
  // Scratch memory for workspaces; freed by the kernel before it returns.
  std::shared_ptr<Allocator> allocator;
  // GEMMs below this many flops run on one thread (Settings::gemm_split_min_flops).
  int64_t gemm_split_min_flops = 4'000'000;
  // The registry the kernel was found in: ops made of other ops (a layer program) run theirs
  // from it. Set by every executor.
  const OpRegistry* registry = nullptr;
  // The GPU of the process (core/device_runtime.h), or null where there is none. kCuda kernels
  // run on it; outputs on the device are allocated from its allocator; transfers use its Copy.
  DeviceRuntime* device = nullptr;
  // The process's swap file (worker/swap_file.h: the disk tier), or null. Outputs on the disk are
  // allocated from its allocator; copies to and from it use its Copy.
  DeviceRuntime* disk = nullptr;
};

// Copies src's bytes into dst, each on its tier: host to host directly, to or from the disk
// through the context's swap file, else through its GPU (Infeasible naming what the process
// lacks). REQUIRES: both hold src.bytes().
Status CopyAcrossTiers(const Tensor& dst, const Tensor& src, const KernelContext& context);

using InferFn = std::function<Result<std::vector<TensorMeta>>(const std::vector<TensorMeta>& inputs,
                                                              const Attrs& attrs)>;
using CostFn = std::function<OpCost(const std::vector<TensorMeta>& inputs, const Attrs& attrs)>;
// Bytes of scratch (KernelContext::allocator) the op's kernel on the inputs' device holds at most
// while it runs, on top of its outputs; 0 for none.
using WorkspaceFn =
    std::function<int64_t(const std::vector<TensorMeta>& inputs, const Attrs& attrs)>;
// Inference and cost of ops made of other ops: they see the registry they are in.
using NestedInferFn = std::function<Result<std::vector<TensorMeta>>(
    const OpRegistry& registry, const std::vector<TensorMeta>& inputs, const Attrs& attrs)>;
using NestedCostFn = std::function<Result<OpCost>(
    const OpRegistry& registry, const std::vector<TensorMeta>& inputs, const Attrs& attrs)>;
using NestedWorkspaceFn = std::function<Result<int64_t>(
    const OpRegistry& registry, const std::vector<TensorMeta>& inputs, const Attrs& attrs)>;
// REQUIRES: inputs/outputs match the op's inferred metas; outputs are allocated, and in-place
// outputs hold their input's contents. Returns InvalidArgument for data-dependent errors (a
// token id out of range); shape errors are caught earlier by inference.
using KernelFn =
    std::function<Status(const KernelContext& context, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& outputs, const Attrs& attrs)>;

// How an op's gradient is computed: the op that computes it and what that op reads. A model's
// backward is derived from these rules (model/), so a user never writes one.
//
// The backward op's inputs are, in order, `inputs`: gradients of the forward op's outputs
// (kOutputGradient; an output no one used gets zeros), the forward op's inputs (kInput) and its
// outputs (kOutput, e.g. layernorm's mean and rstd). Output j of the backward op is the gradient
// of forward input `gradient_of[j]`. Forward inputs named in no gradient_of (token ids, targets)
// are not differentiable. The backward op gets the forward op's attributes.
struct GradientRule {
  enum class From : uint8_t { kOutputGradient, kInput, kOutput };
  struct Arg {
    From from;
    int index;
  };
  std::string op;
  std::vector<Arg> inputs;
  std::vector<int> gradient_of;
  // Optional (both or neither), for zero-bubble pipelines: the same gradients from two ops that
  // read the same `inputs`. input_op returns those of gradient_of[0, split_at) (an activation's),
  // weight_op those of gradient_of[split_at, end) (the parameters'), each as `op` computes them.
  std::string input_op, weight_op;
  int split_at = 0;
};

struct OpDef {
  std::string name;
  std::string doc;
  std::vector<std::string> input_names;  // for messages; its size is the arity
  std::vector<std::string> output_names;
  bool variadic_inputs = false;  // any number >= 1 of inputs named input_names[0]
  // As many outputs as inference returns; past output_names, each is named after the last.
  bool variadic_outputs = false;
  // Inputs after the named ones are control inputs: they only order the task after their
  // producers; the op ignores them, and inference and cost see the named inputs only. Like any
  // input, one stays live until the task ends (a collective's: until every member has come), so
  // the planner orders its tasks by control edges (TaskSpec::after) instead, which hold nothing.
  bool control_inputs = false;
  // A transfer: inputs may live on any device (copies between a worker's GPU and its host tier).
  // Every other op reads only objects on the device its task runs on (GraphBuilder checks).
  bool crosses_devices = false;
  std::vector<std::pair<int, int>> in_place;  // (input index, output index)
  InferFn infer;
  CostFn cost;
  // Instead of infer and cost, for ops made of other ops (ops/layer_program.h).
  NestedInferFn nested_infer;
  NestedCostFn nested_cost;
  // The kernels' scratch space (either or neither; none: the kernel takes none worth counting:
  // a few rows' worth at most). The memory model counts it while the task runs
  // (planner/memory_model.h), and the executor measures it (worker/role_meter.h). The figures
  // are the CPU kernels'; GPU kernels' scratch is not counted yet.
  WorkspaceFn workspace;
  NestedWorkspaceFn nested_workspace;
  // Absent: the op has no gradient (optimizer steps, collectives, backward ops themselves).
  std::optional<GradientRule> gradient;
  // A layer forward whose backward can recompute part of what the forward saves instead of
  // reading it: the values of attribute "rebuild" (kRebuildAttr, ops/standard_ops.h) that the
  // op and its backward accept, least recomputed first, and the work the backward repeats for
  // one (rebuild_cost, given the forward's inputs and its attributes with "rebuild" set). The
  // memory planner offers them to its solver beside keeping and recomputing whole layers. An
  // option the op cannot apply to given inputs (nothing to rebuild, another dtype) fails
  // inference or keeps as much as without it; the planner then skips it.
  std::vector<std::string> rebuild_options;
  NestedCostFn rebuild_cost;
};

class OpRegistry {
 public:
  OpRegistry() = default;
  // Moving is for building one (MakeCpuOpRegistry returns it): REQUIRES no other thread uses
  // either registry.
  OpRegistry(OpRegistry&& other) noexcept;
  OpRegistry& operator=(OpRegistry&& other) noexcept;
  OpRegistry(const OpRegistry&) = delete;
  OpRegistry& operator=(const OpRegistry&) = delete;

  // AlreadyExists when the name is taken; InvalidArgument when infer or cost is missing.
  Status AddOp(OpDef def);
  // NotFound for an unknown op; AlreadyExists for a second kernel on the same device kind.
  Status AddKernel(std::string_view op, DeviceKind device, KernelFn kernel);

  // NotFound naming the op otherwise.
  Result<const OpDef*> Find(std::string_view op) const;
  bool Supports(std::string_view op, DeviceKind device) const;
  // NotFound naming the op and device otherwise.
  Result<const KernelFn*> FindKernel(std::string_view op, DeviceKind device) const;

  // Checks the arity, then runs the op's inference. Errors name the op.
  Result<std::vector<TensorMeta>> InferShapes(std::string_view op,
                                              const std::vector<TensorMeta>& inputs,
                                              const Attrs& attrs) const;
  Result<OpCost> Cost(std::string_view op, const std::vector<TensorMeta>& inputs,
                      const Attrs& attrs) const;
  // OpDef::workspace's bytes (0 where the op declares none, and for inputs off the host: GPU
  // kernels' scratch is not counted yet). Errors name the op.
  Result<int64_t> Workspace(std::string_view op, const std::vector<TensorMeta>& inputs,
                            const Attrs& attrs) const;

  std::vector<std::string> OpNames() const;

 private:
  struct Entry {
    OpDef def;
    std::map<DeviceKind, KernelFn> kernels;
  };
  // Pointers into the map (std::map nodes) stay valid across insertions.
  mutable SharedMutex mutex_;
  std::map<std::string, Entry, std::less<>> ops_ GUARDED_BY(mutex_);
};

}  // namespace tessera
