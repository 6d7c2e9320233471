#include "ops/cpu/cpu_kernels.h"

#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core/atomic_file.h"
#include "core/block_quantization.h"
#include "core/checksum.h"
#include "core/collective_task.h"
#include "core/half.h"
#include "core/sign_compression.h"
#include "ops/bucket_copies.h"
#include "ops/cpu/kernel_glue.h"
#include "ops/cpu/kernels.h"
#include "ops/cpu/tensor_parallel.h"
#include "ops/cpu/transformer_layers.h"
#include "ops/cpu/volume_kernels.h"
#include "ops/flat_layout.h"
#include "ops/kernel_attrs.h"
#include "ops/layer_program.h"
#include "ops/plugin.h"
#include "ops/standard_ops.h"

namespace tessera {

namespace {

using cpu::detail::F;
using cpu::detail::I;
using cpu::detail::Register;
using cpu::detail::Tensors;
using cpu::detail::Workspace;

// The gradient-bucket ops' copies on the host.
constexpr auto kHostCopy = [](void* dst, const void* src, int64_t bytes) {
  std::memcpy(dst, src, static_cast<size_t>(bytes));
  return Status::Ok();
};

int64_t Rows(const Tensor& t) { return t.shape().rank() == 0 ? 1 : t.numel() / t.shape()[-1]; }
int64_t LastDim(const Tensor& t) { return t.shape()[-1]; }

cpu::TransformerDims Dims(const Attrs& attrs, const Tensor& x) {
  return ReadTransformerDims(attrs, x.meta());
}

// Zeros the padding of a parameter-group gradient beyond the layout's `used` elements (groups
// padded for ZeRO shards: attribute param_multiple).
void ZeroPadding(const Tensor& group, int64_t used) {
  std::fill(F(group) + used, F(group) + group.numel(), 0.0f);
}

Status RegisterPrimitiveKernels(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(Register(
      r, "embedding_forward",
      [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
        return cpu::EmbeddingForward(F(out[0]), I(in[0]), F(in[1]), F(in[2]), in[0].shape()[0],
                                     in[0].shape()[1], in[1].shape()[1], in[1].shape()[0]);
      }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "embedding_backward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 std::memset(out[0].raw_data(), 0, static_cast<size_t>(out[0].bytes()));
                 std::memset(out[1].raw_data(), 0, static_cast<size_t>(out[1].bytes()));
                 for (int64_t i = 0; i < in[1].numel(); ++i) {
                   if (I(in[1])[i] < 0 || I(in[1])[i] >= out[0].shape()[0]) {
                     return InvalidArgument("token id {} is outside the vocabulary [0, {})",
                                            I(in[1])[i], out[0].shape()[0]);
                   }
                 }
                 cpu::EmbeddingBackward(F(out[0]), F(out[1]), F(in[0]), I(in[1]), in[0].shape()[0],
                                        in[0].shape()[1], in[0].shape()[2]);
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "layernorm_forward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 cpu::LayerNormForward(F(out[0]), F(out[1]), F(out[2]), F(in[0]), F(in[1]),
                                       F(in[2]), Rows(in[0]), LastDim(in[0]));
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "layernorm_backward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 cpu::LayerNormBackward(F(out[0]), F(out[1]), F(out[2]), F(in[0]), F(in[1]),
                                        F(in[2]), F(in[3]), F(in[4]), Rows(in[1]), LastDim(in[1]),
                                        /*accumulate_dx=*/false);
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "linear_forward",
               [](const KernelContext& ctx, const Tensors& in, const Tensors& out, const Attrs&) {
                 cpu::LinearForward(F(out[0]), F(in[0]), F(in[1]), F(in[2]), nullptr, Rows(in[0]),
                                    LastDim(in[0]), in[1].shape()[0], ctx.gemm_split_min_flops);
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "linear_backward",
               [](const KernelContext& ctx, const Tensors& in, const Tensors& out, const Attrs&) {
                 cpu::LinearBackward(F(out[0]), F(out[1]), F(out[2]), F(in[0]), F(in[1]), F(in[2]),
                                     Rows(in[1]), LastDim(in[1]), in[2].shape()[0], false,
                                     ctx.gemm_split_min_flops);
                 return Status::Ok();
               }));
  // The halves: LinearBackward skips dweight (and dbias) or dx when given null.
  TESSERA_RETURN_IF_ERROR(Register(
      r, "linear_backward_input",
      [](const KernelContext& ctx, const Tensors& in, const Tensors& out, const Attrs&) {
        cpu::LinearBackward(F(out[0]), nullptr, nullptr, F(in[0]), F(in[1]), F(in[2]), Rows(in[1]),
                            LastDim(in[1]), in[2].shape()[0], false, ctx.gemm_split_min_flops);
        return Status::Ok();
      }));
  for (const char* name : {"linear_backward_weight", "linear_no_bias_backward_weight"}) {
    TESSERA_RETURN_IF_ERROR(Register(
        r, name, [](const KernelContext& ctx, const Tensors& in, const Tensors& out, const Attrs&) {
          cpu::LinearBackward(nullptr, F(out[0]), out.size() > 1 ? F(out[1]) : nullptr, F(in[0]),
                              F(in[1]), F(in[2]), Rows(in[1]), LastDim(in[1]), in[2].shape()[0],
                              false, ctx.gemm_split_min_flops);
          return Status::Ok();
        }));
  }
  TESSERA_RETURN_IF_ERROR(
      Register(r, "linear_no_bias_forward",
               [](const KernelContext& ctx, const Tensors& in, const Tensors& out, const Attrs&) {
                 cpu::LinearForward(F(out[0]), F(in[0]), F(in[1]), nullptr, nullptr, Rows(in[0]),
                                    LastDim(in[0]), in[1].shape()[0], ctx.gemm_split_min_flops);
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "linear_no_bias_backward",
               [](const KernelContext& ctx, const Tensors& in, const Tensors& out, const Attrs&) {
                 cpu::LinearBackward(F(out[0]), F(out[1]), nullptr, F(in[0]), F(in[1]), F(in[2]),
                                     Rows(in[1]), LastDim(in[1]), in[2].shape()[0], false,
                                     ctx.gemm_split_min_flops);
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "matmul_forward",
               [](const KernelContext& ctx, const Tensors& in, const Tensors& out, const Attrs&) {
                 cpu::MatmulForward(F(out[0]), F(in[0]), F(in[1]), in[0].shape()[0],
                                    in[0].shape()[1], in[1].shape()[1], ctx.gemm_split_min_flops);
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "matmul_backward",
      [](const KernelContext& ctx, const Tensors& in, const Tensors& out, const Attrs&) {
        cpu::MatmulBackward(F(out[0]), F(out[1]), F(in[0]), F(in[1]), F(in[2]), in[1].shape()[0],
                            in[1].shape()[1], in[2].shape()[1], ctx.gemm_split_min_flops);
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "attention_forward",
      [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        cpu::AttentionForward(F(out[0]), F(out[1]), F(in[0]), in[0].shape()[0], in[0].shape()[1],
                              in[0].shape()[2] / 3, attrs.GetInt("heads", 1));
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "attention_backward",
      [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        cpu::AttentionBackward(F(out[0]), F(in[0]), F(in[1]), F(in[2]), in[1].shape()[0],
                               in[1].shape()[1], in[1].shape()[2] / 3, attrs.GetInt("heads", 1));
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "gelu_forward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 cpu::GeluForward(F(out[0]), F(in[0]), in[0].numel());
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "gelu_backward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 cpu::GeluBackward(F(out[0]), F(in[0]), F(in[1]), in[0].numel());
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "add_forward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 cpu::Add(F(out[0]), F(in[0]), F(in[1]), in[0].numel());
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "bias_add_forward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 const int64_t c = in[1].numel();
                 const int64_t rows = in[0].numel() / c;
                 const float* x = F(in[0]);
                 const float* b = F(in[1]);
                 float* y = F(out[0]);
                 for (int64_t i = 0; i < rows; ++i) cpu::Add(y + i * c, x + i * c, b, c);
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "bias_add_backward",
      [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
        const int64_t c = out[1].numel();
        const int64_t rows = in[0].numel() / c;
        const float* dout = F(in[0]);
        std::memcpy(out[0].raw_data(), in[0].raw_data(), static_cast<size_t>(in[0].bytes()));
        // Summed in double, row by row: the same order on every rank.
        std::vector<double> sum(static_cast<size_t>(c), 0.0);
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t j = 0; j < c; ++j) sum[static_cast<size_t>(j)] += dout[i * c + j];
        }
        float* db = F(out[1]);
        for (int64_t j = 0; j < c; ++j) db[j] = static_cast<float>(sum[static_cast<size_t>(j)]);
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "accumulate",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 if (in[1].dtype() == DType::kBF16) {  // added in f32, rounded once
                   auto* sum = static_cast<uint16_t*>(out[0].raw_data());
                   const auto* x = static_cast<const uint16_t*>(in[1].raw_data());
                   for (int64_t i = 0; i < in[1].numel(); ++i) {
                     sum[i] = FloatToBf16(Bf16ToFloat(sum[i]) + Bf16ToFloat(x[i]));
                   }
                   return Status::Ok();
                 }
                 cpu::Add(F(out[0]), F(out[0]), F(in[1]), in[0].numel());  // out[0] holds sum
                 return Status::Ok();
               }));
  for (const char* op : {"reshape", "reshape_backward", "identity"}) {
    TESSERA_RETURN_IF_ERROR(Register(
        r, op, [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
          std::memcpy(out[0].raw_data(), in[0].raw_data(), in[0].bytes());
          return Status::Ok();
        }));
  }
  TESSERA_RETURN_IF_ERROR(
      Register(r, "pack_shards",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 return PackShards(in, out[0], attrs.GetInt("ranks", 1), kHostCopy);
               }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "split", [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
        return SplitInto(in[0], out, kHostCopy);
      }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "copy",
      [](const KernelContext& context, const Tensors& in, const Tensors& out, const Attrs&) {
        // Between tiers: offload's gradient download, a swap to or from the disk.
        return CopyAcrossTiers(out[0], in[0], context);
      }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "write_file",
      [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        TESSERA_ASSIGN_OR_RETURN(std::string path, attrs.GetString("path"));
        std::error_code error;
        const std::filesystem::path parent = std::filesystem::path(path).parent_path();
        if (!parent.empty()) std::filesystem::create_directories(parent, error);
        if (error) {
          return Unavailable("cannot create directory '{}': {}", parent.string(), error.message());
        }
        const std::string_view bytes(static_cast<const char*>(in[0].raw_data()),
                                     static_cast<size_t>(in[0].bytes()));
        TESSERA_RETURN_IF_ERROR(WriteFileAtomically(path, bytes));
        int64_t* receipt = out[0].data<int64_t>();
        receipt[0] = in[0].bytes();
        receipt[1] = std::bit_cast<int64_t>(Fnv1a(bytes.data(), bytes.size()));
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "constant",
               [](const KernelContext&, const Tensors&, const Tensors& out, const Attrs& attrs) {
                 *F(out[0]) = static_cast<float>(attrs.GetFloat("value", 0.0));
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "noop", [](const KernelContext&, const Tensors&, const Tensors& out, const Attrs&) {
        *F(out[0]) = 0.0f;
        return Status::Ok();
      }));
  // Collective members of a one-member group are copies; larger groups need a communicator,
  // which the worker's collective engine provides (it runs those tasks instead of a kernel).
  for (const char* collective : {"all_reduce", "reduce_scatter", "all_gather",
                                 "all_gather_in_place", "all_to_all", "broadcast"}) {
    TESSERA_RETURN_IF_ERROR(Register(
        r, collective,
        [collective](const KernelContext&, const Tensors& in, const Tensors& out,
                     const Attrs& attrs) {
          const int64_t size = attrs.GetInt(kGroupSizeAttr, 1);
          if (size != 1) {
            return Internal(
                "{} of {} members needs a worker's communicator; this executor runs only "
                "one-member collectives",
                collective, size);
          }
          if (attrs.Has(kQuantizeBitsAttr)) {
            // A group of one still quantizes (the bits a group would decode).
            const auto bits = static_cast<int>(attrs.GetInt(kQuantizeBitsAttr, 8));
            std::vector<uint32_t> words(static_cast<size_t>(QuantizedWords(in[0].numel(), bits)));
            QuantizeBlocks(F(in[0]), in[0].numel(), bits, words.data());
            DequantizeBlocks(words.data(), in[0].numel(), bits, F(out[0]));
            return Status::Ok();
          }
          if (out[0].raw_data() != in[0].raw_data()) {
            std::memcpy(out[0].raw_data(), in[0].raw_data(), static_cast<size_t>(in[0].bytes()));
          }
          return Status::Ok();
        }));
  }
  // A one-member compressed all-reduce still compresses (the same bits a group computes, with
  // the errors it keeps): the worker's half, the server's, decoded.
  TESSERA_RETURN_IF_ERROR(Register(
      r, "compressed_all_reduce",
      [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        const int64_t size = attrs.GetInt(kGroupSizeAttr, 1);
        if (size != 1) {
          return Internal(
              "compressed_all_reduce of {} members needs a worker's communicator; this executor "
              "runs only one-member collectives",
              size);
        }
        for (size_t i = 0; i < 3; ++i) {
          if (out[i].raw_data() != in[i].raw_data()) {
            std::memcpy(out[i].raw_data(), in[i].raw_data(), static_cast<size_t>(in[i].bytes()));
          }
        }
        TESSERA_ASSIGN_OR_RETURN(const int64_t count, CompressedCount(attrs, out[0].numel()));
        std::vector<uint32_t> sent(
            static_cast<size_t>(SignBlockWords(SignChunkElements(count, 1))));
        std::vector<uint32_t> served(sent.size());
        CompressWorkerChunks(F(out[0]), count, 1, F(out[1]), sent.data());
        ServeSignChunk(sent.data(), 1, count, 1, 0, F(out[2]), served.data());
        DecodeSignChunks(served.data(), count, 1, F(out[0]));
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "sum_scalars",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 double sum = 0;
                 for (const Tensor& x : in) sum += *F(x);  // in order: every rank adds alike
                 *F(out[0]) = static_cast<float>(sum * attrs.GetFloat("scale", 1.0));
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "sleep",
      [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        std::this_thread::sleep_for(std::chrono::milliseconds(attrs.GetInt("ms", 0)));
        std::memcpy(out[0].raw_data(), in[0].raw_data(), static_cast<size_t>(in[0].bytes()));
        return Status::Ok();
      }));
  return Register(
      r, "add_backward",
      [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
        std::memcpy(out[0].raw_data(), in[0].raw_data(), static_cast<size_t>(in[0].bytes()));
        std::memcpy(out[1].raw_data(), in[0].raw_data(), static_cast<size_t>(in[0].bytes()));
        return Status::Ok();
      });
}

Status RegisterLossAndOptimizerKernels(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(
      Register(r, "loss_gradient",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 const float scale = *F(in[0]);
                 if (in[1].dtype() == DType::kBF16) {  // a volume loss's over bf16 logits
                   const auto* dlogits = static_cast<const uint16_t*>(in[1].raw_data());
                   auto* dx = static_cast<uint16_t*>(out[0].raw_data());
                   for (int64_t i = 0; i < in[1].numel(); ++i) {
                     dx[i] = FloatToBf16(Bf16ToFloat(dlogits[i]) * scale);
                   }
                   return Status::Ok();
                 }
                 const float* dlogits = F(in[1]);
                 float* dx = F(out[0]);
                 for (int64_t i = 0; i < in[1].numel(); ++i) dx[i] = dlogits[i] * scale;
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "softmax_cross_entropy",
      [](const KernelContext&, const Tensors& in, const Tensors& out,
         const Attrs& attrs) -> Status {
        // out[1] holds the logits (in place); the kernel overwrites them with their gradient.
        TESSERA_ASSIGN_OR_RETURN(
            float loss,
            cpu::SoftmaxCrossEntropy(F(out[1]), F(out[1]), I(in[1]), Rows(out[1]), LastDim(out[1]),
                                     static_cast<float>(attrs.GetFloat("grad_scale", 1.0))));
        *F(out[0]) = loss;
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "adamw",
      [](const KernelContext&, const Tensors& in, const Tensors& out,
         const Attrs& attrs) -> Status {
        const int64_t n = in[1].numel();
        const AdamWAttrs a = ReadAdamWAttrs(attrs, n);
        const cpu::AdamWConfig config{
            .beta1 = a.beta1, .beta2 = a.beta2, .eps = a.eps, .weight_decay = a.weight_decay};
        const int64_t step = *in[6].data<int64_t>();
        if (step < 1) return InvalidArgument("adamw step must be >= 1, got {}", step);
        cpu::AdamWUpdate(F(out[0]) + a.param_offset, F(out[1]), F(out[2]), F(in[1]), n, config,
                         *F(in[5]), step, *F(in[4]), a.decay_ranges.data(),
                         static_cast<int64_t>(a.decay_ranges.size() / 2), a.element_offset);
        return Status::Ok();
      }));
  const auto onebit_config = [](const AdamWAttrs& a) {
    return cpu::OneBitAdamConfig{
        .beta1 = a.beta1, .beta2 = a.beta2, .eps = a.eps, .weight_decay = a.weight_decay};
  };
  TESSERA_RETURN_IF_ERROR(Register(
      r, "onebit_adam",
      [onebit_config](const KernelContext&, const Tensors& in, const Tensors& out,
                      const Attrs& attrs) {
        const int64_t n = in[1].numel();
        const AdamWAttrs a = ReadAdamWAttrs(attrs, n);
        cpu::OneBitAdamWarmup(F(out[0]) + a.param_offset, F(out[1]), F(out[2]), F(in[1]), n,
                              onebit_config(a), *F(in[5]), *F(in[4]), a.decay_ranges.data(),
                              static_cast<int64_t>(a.decay_ranges.size() / 2), a.element_offset);
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "onebit_adam_momentum",
      [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        cpu::OneBitAdamMomentum(F(out[0]), F(in[1]), out[0].numel(),
                                static_cast<float>(attrs.GetFloat("beta1", 0.9)), *F(in[2]));
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "onebit_adam_frozen",
      [onebit_config](const KernelContext&, const Tensors& in, const Tensors& out,
                      const Attrs& attrs) {
        const int64_t n = in[2].numel();
        const AdamWAttrs a = ReadAdamWAttrs(attrs, n);
        cpu::OneBitAdamFrozenUpdate(F(out[0]) + a.param_offset, F(in[1]) + a.param_offset, F(in[2]),
                                    n, onebit_config(a), *F(in[3]), a.decay_ranges.data(),
                                    static_cast<int64_t>(a.decay_ranges.size() / 2),
                                    a.element_offset);
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "zero_one_adam_compressed",
      [onebit_config](const KernelContext&, const Tensors& in, const Tensors& out,
                      const Attrs& attrs) {
        const int64_t n = in[0].numel();
        const AdamWAttrs a = ReadAdamWAttrs(attrs, n);
        cpu::OneBitAdamMomentum(F(out[1]), F(in[1]), n, a.beta1, 1.0f);
        cpu::OneBitAdamFrozenUpdate(
            F(out[0]), F(out[1]), F(out[2]), n, onebit_config(a), *F(in[4]), a.decay_ranges.data(),
            static_cast<int64_t>(a.decay_ranges.size() / 2), a.element_offset);
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "zero_one_adam_local",
      [onebit_config](const KernelContext&, const Tensors& in, const Tensors& out,
                      const Attrs& attrs) {
        const int64_t n = in[0].numel();
        const AdamWAttrs a = ReadAdamWAttrs(attrs, n);
        cpu::ZeroOneAdamLocal(F(out[0]), F(out[1]), F(out[2]), F(out[3]), F(in[1]), n,
                              onebit_config(a), *F(in[6]), *F(in[5]), attrs.GetInt("sync", 0) != 0,
                              a.decay_ranges.data(),
                              static_cast<int64_t>(a.decay_ranges.size() / 2), a.element_offset);
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "zero_one_adam_sync",
      [onebit_config](const KernelContext&, const Tensors& in, const Tensors& out,
                      const Attrs& attrs) -> Status {
        const int64_t n = in[0].numel();
        const AdamWAttrs a = ReadAdamWAttrs(attrs, n);
        const float lr_sum = *F(in[4]);
        if (!(lr_sum > 0)) {
          return InvalidArgument("0/1 Adam's synchronisation needs lr_sum > 0, got {}", lr_sum);
        }
        cpu::ZeroOneAdamSyncEnd(F(out[0]), F(out[1]), F(out[2]), F(out[3]), n, onebit_config(a),
                                lr_sum, a.decay_ranges.data(),
                                static_cast<int64_t>(a.decay_ranges.size() / 2), a.element_offset);
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "scale", [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
        cpu::ScaleInPlace(F(out[0]), in[0].numel(), *F(in[1]));
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "sgd",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 cpu::SgdUpdate(F(out[0]), F(in[1]), out[0].numel(), *F(in[3]),
                                static_cast<float>(attrs.GetFloat("weight_decay", 0.0)), *F(in[2]));
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "sum_of_squares",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 if (!attrs.Has("ranges")) {
                   *F(out[0]) = static_cast<float>(cpu::SumOfSquares(F(in[0]), in[0].numel()));
                   return Status::Ok();
                 }
                 TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> ranges, attrs.GetInts("ranges"));
                 double sum = 0;
                 for (size_t i = 0; i + 1 < ranges.size(); i += 2) {
                   sum += cpu::SumOfSquares(F(in[0]) + ranges[i], ranges[i + 1] - ranges[i]);
                 }
                 *F(out[0]) = static_cast<float>(sum);
                 return Status::Ok();
               }));
  return Register(
      r, "clip_scale",
      [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        double sum = 0.0;
        for (const Tensor& t : in) sum += static_cast<double>(*F(t));
        const double norm = std::sqrt(sum);
        *F(out[0]) = cpu::ClipScale(norm, attrs.GetFloat("max_norm", 0.0));
        *F(out[1]) = static_cast<float>(norm);
        return Status::Ok();
      });
}

Status RegisterTransformerLayerKernels(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(
      Register(r, "token_position_embedding_forward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 return cpu::TokenPositionEmbeddingForward(F(out[0]), I(in[0]), F(in[1]),
                                                           Dims(attrs, out[0]));
               }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "token_position_embedding_backward",
      [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        cpu::TokenPositionEmbeddingBackward(F(out[0]), F(in[0]), I(in[1]), Dims(attrs, in[0]));
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "transformer_block_forward",
               [](const KernelContext& ctx, const Tensors& in, const Tensors& out,
                  const Attrs& attrs) -> Status {
                 const cpu::TransformerDims dims = Dims(attrs, in[0]);
                 // What the backward rebuilds is made here too, but not kept.
                 TESSERA_ASSIGN_OR_RETURN(Tensor workspace,
                                          Workspace(ctx, TransformerBlockForwardWorkspace(dims)));
                 cpu::TransformerBlockForward(F(out[0]), F(out[1]), F(workspace), F(in[0]),
                                              F(in[1]), dims, ctx.gemm_split_min_flops);
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "transformer_block_backward",
               [](const KernelContext& ctx, const Tensors& in, const Tensors& out,
                  const Attrs& attrs) -> Status {
                 const cpu::TransformerDims dims = Dims(attrs, in[1]);
                 TESSERA_ASSIGN_OR_RETURN(Tensor workspace,
                                          Workspace(ctx, TransformerBlockBackwardWorkspace(dims)));
                 // out[0] holds dy on entry (in place) and dx on exit.
                 cpu::TransformerBlockBackward(F(out[0]), F(out[1]), F(workspace), F(in[1]),
                                               F(in[2]), F(in[3]), dims, ctx.gemm_split_min_flops);
                 ZeroPadding(out[1], TransformerBlockParamLayout(dims.channels).numel());
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "transformer_block_backward_input",
      [](const KernelContext& ctx, const Tensors& in, const Tensors& out,
         const Attrs& attrs) -> Status {
        const cpu::TransformerDims dims = Dims(attrs, in[1]);
        TESSERA_ASSIGN_OR_RETURN(Tensor workspace,
                                 Workspace(ctx, TransformerBlockInputWorkspace(dims)));
        cpu::TransformerBlockBackwardInput(F(out[0]), F(out[1]), F(workspace), F(in[1]), F(in[2]),
                                           F(in[3]), dims, ctx.gemm_split_min_flops);
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "transformer_block_backward_weight",
               [](const KernelContext& ctx, const Tensors& in, const Tensors& out,
                  const Attrs& attrs) -> Status {
                 const cpu::TransformerDims dims = Dims(attrs, in[1]);
                 cpu::TransformerBlockBackwardWeight(F(out[0]), F(in[0]), F(in[2]), dims,
                                                     ctx.gemm_split_min_flops);
                 ZeroPadding(out[0], TransformerBlockParamLayout(dims.channels).numel());
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "tied_lm_head_forward",
      [](const KernelContext& ctx, const Tensors& in, const Tensors& out,
         const Attrs& attrs) -> Status {
        TESSERA_ASSIGN_OR_RETURN(
            float loss,
            cpu::TiedLmHeadForward(
                F(out[1]), F(in[0]), F(in[1]), F(in[2]), I(in[3]), Dims(attrs, in[0]),
                static_cast<float>(attrs.GetFloat("grad_scale", 1.0)), ctx.gemm_split_min_flops));
        *F(out[0]) = loss;
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "tied_lm_head_backward",
      [](const KernelContext& ctx, const Tensors& in, const Tensors& out,
         const Attrs& attrs) -> Status {
        const cpu::TransformerDims dims = Dims(attrs, in[0]);
        TESSERA_ASSIGN_OR_RETURN(Tensor workspace, Workspace(ctx, TiedLmHeadWorkspace(dims)));
        cpu::TiedLmHeadBackward(F(out[0]), F(out[1]), F(out[2]), F(workspace), F(in[0]), F(in[1]),
                                F(in[2]), F(in[3]), dims, ctx.gemm_split_min_flops);
        ZeroPadding(out[1], TiedLmHeadParamLayout(dims.channels).numel());
        ZeroPadding(
            out[2],
            TokenPositionEmbeddingParamLayout(dims.vocab, dims.max_seq_len, dims.channels).numel());
        return Status::Ok();
      }));
  return Register(r, "tied_lm_head_logits",
                  [](const KernelContext& ctx, const Tensors& in, const Tensors& out,
                     const Attrs& attrs) -> Status {
                    const cpu::TransformerDims dims = Dims(attrs, in[0]);
                    TESSERA_ASSIGN_OR_RETURN(Tensor workspace,
                                             Workspace(ctx, TiedLmHeadWorkspace(dims)));
                    cpu::TiedLmHeadLogits(F(out[0]), F(workspace), F(in[0]), F(in[1]), F(in[2]),
                                          dims, ctx.gemm_split_min_flops);
                    return Status::Ok();
                  });
}

}  // namespace

Status RegisterCpuKernels(OpRegistry& registry) {
  TESSERA_RETURN_IF_ERROR(RegisterPrimitiveKernels(registry));
  TESSERA_RETURN_IF_ERROR(RegisterLossAndOptimizerKernels(registry));
  TESSERA_RETURN_IF_ERROR(RegisterTransformerLayerKernels(registry));
  TESSERA_RETURN_IF_ERROR(RegisterVolumeKernels(registry));
  TESSERA_RETURN_IF_ERROR(RegisterTensorParallelKernels(registry));
  TESSERA_RETURN_IF_ERROR(RegisterLayerProgramKernels(registry, DeviceKind::kCpu));
  return AddLoadedPluginKernels(registry, DeviceKind::kCpu);
}

Result<OpRegistry> MakeCpuOpRegistry() {
  OpRegistry registry;
  TESSERA_RETURN_IF_ERROR(RegisterStandardOps(registry));
  TESSERA_RETURN_IF_ERROR(RegisterCpuKernels(registry));
  return registry;
}

}  // namespace tessera
