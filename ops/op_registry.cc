#include "ops/op_registry.h"

#include <cstring>

namespace tessera {

namespace {

// The inputs an op's cost and workspace see: the named ones, without control inputs.
std::vector<TensorMeta> NamedInputs(const OpDef& def, const std::vector<TensorMeta>& inputs) {
  std::vector<TensorMeta> named = inputs;
  if (def.control_inputs && inputs.size() > def.input_names.size()) {
    named.resize(def.input_names.size());
  }
  return named;
}

}  // namespace

OpRegistry::OpRegistry(OpRegistry&& other) noexcept {
  WriterLock lock(&other.mutex_);
  ops_ = std::move(other.ops_);
}

OpRegistry& OpRegistry::operator=(OpRegistry&& other) noexcept {
  if (this == &other) return *this;
  std::map<std::string, Entry, std::less<>> moved;
  {
    WriterLock lock(&other.mutex_);
    moved = std::move(other.ops_);
  }
  WriterLock lock(&mutex_);
  ops_ = std::move(moved);
  return *this;
}

Status OpRegistry::AddOp(OpDef def) {
  if (!(def.infer || def.nested_infer) || !(def.cost || def.nested_cost)) {
    return InvalidArgument("op '{}' needs both shape inference and a cost function", def.name);
  }
  WriterLock lock(&mutex_);
  if (ops_.contains(def.name)) return AlreadyExists("op '{}' is already registered", def.name);
  std::string name = def.name;
  ops_.emplace(std::move(name), Entry{std::move(def), {}});
  return Status::Ok();
}

Status OpRegistry::AddKernel(std::string_view op, DeviceKind device, KernelFn kernel) {
  WriterLock lock(&mutex_);
  auto it = ops_.find(op);
  if (it == ops_.end()) return NotFound("cannot add a kernel to unknown op '{}'", op);
  if (!it->second.kernels.emplace(device, std::move(kernel)).second) {
    return AlreadyExists("op '{}' already has a {} kernel", op, DeviceKindName(device));
  }
  return Status::Ok();
}

Result<const OpDef*> OpRegistry::Find(std::string_view op) const {
  ReaderLock lock(&mutex_);
  auto it = ops_.find(op);
  if (it == ops_.end()) return NotFound("unknown op '{}'", op);
  return &it->second.def;
}

bool OpRegistry::Supports(std::string_view op, DeviceKind device) const {
  ReaderLock lock(&mutex_);
  auto it = ops_.find(op);
  return it != ops_.end() && it->second.kernels.contains(device);
}

Result<const KernelFn*> OpRegistry::FindKernel(std::string_view op, DeviceKind device) const {
  ReaderLock lock(&mutex_);
  auto it = ops_.find(op);
  if (it == ops_.end()) return NotFound("unknown op '{}'", op);
  auto kernel = it->second.kernels.find(device);
  if (kernel == it->second.kernels.end()) {
    return NotFound("op '{}' has no {} kernel", op, DeviceKindName(device));
  }
  return &kernel->second;
}

Result<std::vector<TensorMeta>> OpRegistry::InferShapes(std::string_view op,
                                                        const std::vector<TensorMeta>& inputs,
                                                        const Attrs& attrs) const {
  TESSERA_ASSIGN_OR_RETURN(const OpDef* def, Find(op));
  const size_t arity = def->input_names.size();
  if (def->control_inputs) {
    if (inputs.size() < arity) {
      return InvalidArgument("op '{}' takes {} inputs (and any control inputs), got {}", op, arity,
                             inputs.size());
    }
    const std::vector<TensorMeta> named(inputs.begin(), inputs.begin() + static_cast<long>(arity));
    Result<std::vector<TensorMeta>> outputs =
        def->nested_infer ? def->nested_infer(*this, named, attrs) : def->infer(named, attrs);
    if (!outputs.ok()) return outputs.status().WithContext(fmt::format("op '{}'", op));
    return outputs;
  }
  if (!def->variadic_inputs && inputs.size() != arity) {
    return InvalidArgument("op '{}' takes {} inputs, got {}", op, arity, inputs.size());
  }
  Result<std::vector<TensorMeta>> outputs =
      def->nested_infer ? def->nested_infer(*this, inputs, attrs) : def->infer(inputs, attrs);
  if (!outputs.ok()) return outputs.status().WithContext(fmt::format("op '{}'", op));
  if (!def->variadic_outputs && outputs->size() != def->output_names.size()) {
    return Internal("op '{}' inferred {} outputs, declares {}", op, outputs->size(),
                    def->output_names.size());
  }
  return outputs;
}

Result<OpCost> OpRegistry::Cost(std::string_view op, const std::vector<TensorMeta>& inputs,
                                const Attrs& attrs) const {
  TESSERA_ASSIGN_OR_RETURN(const OpDef* def, Find(op));
  const std::vector<TensorMeta> named = NamedInputs(*def, inputs);
  if (def->nested_cost) return def->nested_cost(*this, named, attrs);
  return def->cost(named, attrs);
}

Result<int64_t> OpRegistry::Workspace(std::string_view op, const std::vector<TensorMeta>& inputs,
                                      const Attrs& attrs) const {
  TESSERA_ASSIGN_OR_RETURN(const OpDef* def, Find(op));
  for (const TensorMeta& input : inputs) {
    if (!input.device.is_cpu()) return int64_t{0};
  }
  const std::vector<TensorMeta> named = NamedInputs(*def, inputs);
  if (def->nested_workspace) return def->nested_workspace(*this, named, attrs);
  return def->workspace ? def->workspace(named, attrs) : int64_t{0};
}

std::vector<std::string> OpRegistry::OpNames() const {
  ReaderLock lock(&mutex_);
  std::vector<std::string> names;
  names.reserve(ops_.size());
  for (const auto& [name, entry] : ops_) names.push_back(name);
  return names;
}

Status CopyAcrossTiers(const Tensor& dst, const Tensor& src, const KernelContext& context) {
  const Device from = src.meta().device, to = dst.meta().device;
  if (from.is_cpu() && to.is_cpu()) {
    std::memcpy(dst.raw_data(), src.raw_data(), static_cast<size_t>(src.bytes()));
    return Status::Ok();
  }
  // To or from the disk tier (a swapped activation): the swap file copies.
  const bool disk = from.kind == DeviceKind::kDisk || to.kind == DeviceKind::kDisk;
  DeviceRuntime* runtime = disk ? context.disk : context.device;
  if (runtime == nullptr) {
    return Infeasible("copy from {} to {} needs {}, and this process has none", from.ToString(),
                      to.ToString(), disk ? "a swap file (--swap-dir)" : "a GPU");
  }
  return runtime->Copy(dst.raw_data(), to, src.raw_data(), from, src.bytes());
}

}  // namespace tessera
