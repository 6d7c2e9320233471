#include "ops/cuda/cuda_op_kernels.h"

#include <functional>
#include <string_view>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "ops/bucket_copies.h"
#include "ops/cuda/cuda_context.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/scalars.h"
#include "ops/cuda/transformer_layers.h"
#include "ops/cuda/volume_kernels.h"
#include "ops/flat_layout.h"
#include "ops/kernel_attrs.h"

namespace tessera::cuda {

namespace {

using Tensors = std::vector<Tensor>;

// A kernel body that gets the CudaContext of its KernelContext.
using CudaKernelFn = std::function<Status(CudaContext& cuda, const Tensors& in, const Tensors& out,
                                          const Attrs& attrs)>;

Status Register(OpRegistry& r, std::string_view op, CudaKernelFn body) {
  return r.AddKernel(
      op, DeviceKind::kCuda,
      [body = std::move(body)](const KernelContext& context, const Tensors& in, const Tensors& out,
                               const Attrs& attrs) -> Status {
        if (context.device == nullptr || context.device->device().is_cpu()) {
          return Infeasible(
              "a GPU task ran in a process that opened no GPU (ExecutorOptions::device)");
        }
        auto* cuda = static_cast<CudaContext*>(context.device->native());
        TESSERA_RETURN_IF_ERROR(cuda->Activate());
        return body(*cuda, in, out, attrs);
      });
}

float* F(const Tensor& t) { return t.data<float>(); }
const int32_t* I(const Tensor& t) { return t.data<int32_t>(); }
bf16* B(const Tensor& t) {
  TESSERA_CHECK(t.dtype() == DType::kBF16, "tensor {} read as bf16", t.meta().ToString());
  return static_cast<bf16*>(t.raw_data());
}

Status NeedsBf16(const Tensor& x) {
  if (x.dtype() != DType::kBF16) {
    return InvalidArgument(
        "the transformer layer ops on a GPU take bf16 activations, got {}; build the model "
        "with attribute activation_dtype = bf16 (the examples' --device cuda does)",
        x.meta().ToString());
  }
  return Status::Ok();
}

TransformerDims Dims(const Attrs& attrs, const Tensor& x) {
  return ReadTransformerDims(attrs, x.meta());
}

// Zeros a parameter-group gradient past the layout's `used` elements (ZeRO padding).
Status ZeroPadding(CudaContext& cuda, const Tensor& group, int64_t used) {
  const int64_t padding = group.numel() - used;
  if (padding <= 0) return Status::Ok();
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      F(group) + used, 0, static_cast<size_t>(padding) * sizeof(float), cuda.stream()));
  return Status::Ok();
}

Status RegisterTransformerLayerKernels(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(
      Register(r, "token_position_embedding_forward",
               [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 TESSERA_RETURN_IF_ERROR(NeedsBf16(out[0]));
                 return TokenPositionEmbeddingForward(cuda, B(out[0]), I(in[0]), F(in[1]),
                                                      Dims(attrs, out[0]));
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "token_position_embedding_backward",
               [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 TESSERA_RETURN_IF_ERROR(NeedsBf16(in[0]));
                 return TokenPositionEmbeddingBackward(cuda, F(out[0]), B(in[0]), I(in[1]),
                                                       Dims(attrs, in[0]));
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "transformer_block_forward",
               [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 TESSERA_RETURN_IF_ERROR(NeedsBf16(in[0]));
                 return TransformerBlockForward(cuda, B(out[0]), B(out[1]), B(in[0]), F(in[1]),
                                                Dims(attrs, in[0]));
               }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "transformer_block_backward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) -> Status {
        TESSERA_RETURN_IF_ERROR(NeedsBf16(in[1]));
        const TransformerDims dims = Dims(attrs, in[1]);
        // out[0] holds dy on entry (in place) and dx on exit.
        TESSERA_RETURN_IF_ERROR(TransformerBlockBackward(cuda, B(out[0]), F(out[1]), B(in[1]),
                                                         B(in[2]), F(in[3]), dims));
        return ZeroPadding(cuda, out[1], TransformerBlockParamLayout(dims.channels).numel());
      }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "tied_lm_head_forward",
               [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 TESSERA_RETURN_IF_ERROR(NeedsBf16(in[0]));
                 return TiedLmHeadForward(cuda, F(out[0]), B(out[1]), B(in[0]), F(in[1]), F(in[2]),
                                          I(in[3]), Dims(attrs, in[0]),
                                          static_cast<float>(attrs.GetFloat("grad_scale", 1.0)));
               }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "tied_lm_head_logits",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        TESSERA_RETURN_IF_ERROR(NeedsBf16(in[0]));
        return TiedLmHeadLogits(cuda, F(out[0]), B(in[0]), F(in[1]), F(in[2]), Dims(attrs, in[0]));
      }));
  return Register(
      r, "tied_lm_head_backward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) -> Status {
        TESSERA_RETURN_IF_ERROR(NeedsBf16(in[0]));
        const TransformerDims dims = Dims(attrs, in[0]);
        TESSERA_RETURN_IF_ERROR(TiedLmHeadBackward(cuda, B(out[0]), F(out[1]), F(out[2]), B(in[0]),
                                                   B(in[1]), F(in[2]), F(in[3]), dims));
        TESSERA_RETURN_IF_ERROR(
            ZeroPadding(cuda, out[1], TiedLmHeadParamLayout(dims.channels).numel()));
        return ZeroPadding(
            cuda, out[2],
            TokenPositionEmbeddingParamLayout(dims.vocab, dims.max_seq_len, dims.channels).numel());
      });
}

Status RegisterOptimizerKernels(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(Register(
      r, "adamw",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) -> Status {
        const int64_t n = in[1].numel();
        const AdamWAttrs a = ReadAdamWAttrs(attrs, n);
        const AdamWConfig config{
            .beta1 = a.beta1, .beta2 = a.beta2, .eps = a.eps, .weight_decay = a.weight_decay};
        const std::vector<int64_t>& ranges = a.decay_ranges;
        DecayRanges decay;
        if (ranges.size() / 2 > static_cast<size_t>(kMaxDecayRanges)) {
          return InvalidArgument("adamw on the GPU takes at most {} decay ranges, got {}",
                                 kMaxDecayRanges, ranges.size() / 2);
        }
        decay.count = static_cast<int>(ranges.size() / 2);
        for (int i = 0; i < decay.count; ++i) {
          decay.begin[i] = ranges[2 * static_cast<size_t>(i)];
          decay.end[i] = ranges[2 * static_cast<size_t>(i) + 1];
        }
        return AdamWUpdate(F(out[0]) + a.param_offset, F(out[1]), F(out[2]), F(in[1]), n, config,
                           F(in[5]), in[6].data<int64_t>(), F(in[4]), decay, a.element_offset,
                           cuda.stream());
      }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "sum_of_squares",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) -> Status {
        if (attrs.Has("ranges")) {
          return InvalidArgument(
              "sum_of_squares over ranges (tensor parallelism) runs on CPU workers only");
        }
        TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> scratch,
                                 cuda.Scratch(SumOfSquaresScratch(in[0].numel())));
        return SumOfSquares(F(out[0]), scratch->data(), F(in[0]), in[0].numel(), cuda.stream());
      }));
  return Register(
      r, "clip_scale",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) -> Status {
        std::vector<const float*> sums;
        for (const Tensor& t : in) sums.push_back(F(t));
        return ClipScale(F(out[0]), F(out[1]), sums.data(), static_cast<int>(sums.size()),
                         static_cast<float>(attrs.GetFloat("max_norm", 0.0)), cuda.stream());
      });
}

Status RegisterPlanKernels(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(
      Register(r, "pack_shards",
               [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 const Device device = out[0].meta().device;
                 return PackShards(in, out[0], attrs.GetInt("ranks", 1),
                                   [&](void* dst, const void* src, int64_t bytes) {
                                     return cuda.Copy(dst, device, src, device, bytes);
                                   });
               }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "split", [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs&) {
        const Device device = in[0].meta().device;
        return SplitInto(in[0], out, [&](void* dst, const void* src, int64_t bytes) {
          return cuda.Copy(dst, device, src, device, bytes);
        });
      }));
  for (const char* op : {"copy", "identity"}) {
    TESSERA_RETURN_IF_ERROR(
        Register(r, op, [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs&) {
          return cuda.Copy(out[0].raw_data(), out[0].meta().device, in[0].raw_data(),
                           in[0].meta().device, in[0].bytes());
        }));
  }
  TESSERA_RETURN_IF_ERROR(Register(
      r, "accumulate",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs&) -> Status {
        // out[0] holds the sum so far (in place); bf16 is added in f32 and rounded once.
        if (in[1].dtype() == DType::kBF16) {
          return Accumulate(static_cast<__nv_bfloat16*>(out[0].raw_data()),
                            static_cast<const __nv_bfloat16*>(in[1].raw_data()), in[1].numel(),
                            cuda.stream());
        }
        if (in[1].dtype() != DType::kF32) {
          return InvalidArgument("accumulate on the GPU adds f32 or bf16, got {}",
                                 in[1].meta().ToString());
        }
        return Accumulate(F(out[0]), F(in[1]), in[1].numel(), cuda.stream());
      }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "sum_scalars",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) -> Status {
        ScalarPointers inputs;
        if (in.size() > static_cast<size_t>(kMaxScalarInputs)) {
          return InvalidArgument("sum_scalars on the GPU adds at most {} scalars, got {}",
                                 kMaxScalarInputs, in.size());
        }
        inputs.count = static_cast<int>(in.size());
        for (size_t i = 0; i < in.size(); ++i) inputs.values[i] = F(in[i]);
        return SumScalars(F(out[0]), inputs, static_cast<float>(attrs.GetFloat("scale", 1.0)),
                          cuda.stream());
      }));
  return Register(
      r, "constant",
      [](CudaContext& cuda, const Tensors&, const Tensors& out, const Attrs& attrs) -> Status {
        TESSERA_ASSIGN_OR_RETURN(double value, attrs.GetFloat("value"));
        return Fill(F(out[0]), static_cast<float>(value), cuda.stream());
      });
}

}  // namespace

Status RegisterCudaKernels(OpRegistry& registry) {
  TESSERA_RETURN_IF_ERROR(RegisterTransformerLayerKernels(registry));
  TESSERA_RETURN_IF_ERROR(RegisterOptimizerKernels(registry));
  TESSERA_RETURN_IF_ERROR(RegisterVolumeCudaKernels(registry));  // volume_kernels.h
  return RegisterPlanKernels(registry);
}

Result<std::shared_ptr<DeviceRuntime>> OpenCudaDevice(int device, int64_t memory_cap_bytes) {
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<CudaContext> context,
                           CudaContext::Create(CudaContextOptions{
                               .device = device, .memory_cap_bytes = memory_cap_bytes}));
  return std::shared_ptr<DeviceRuntime>(std::move(context));
}

}  // namespace tessera::cuda
