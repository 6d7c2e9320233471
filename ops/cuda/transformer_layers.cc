#include "ops/cuda/transformer_layers.h"

#include <memory>
#include <string_view>

#include "core/cuda_check.h"
#include "ops/cuda/matmul.h"
#include "ops/cuda/scalars.h"
#include "ops/flat_layout.h"

namespace tessera::cuda {

namespace {

// Scratch of `count` elements of T on the context's device.
template <typename T>
struct Scratch {
  std::shared_ptr<Buffer> buffer;
  T* get() const { return static_cast<T*>(buffer->data()); }
};
template <typename T>
Result<Scratch<T>> MakeScratch(CudaContext& context, int64_t count) {
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> buffer,
                           context.Scratch(count * static_cast<int64_t>(sizeof(T))));
  return Scratch<T>{std::move(buffer)};
}

// The bf16 copy of an fp32 parameter group the GEMMs read.
Result<Scratch<bf16>> Bf16Copy(CudaContext& context, const float* params, int64_t numel) {
  TESSERA_ASSIGN_OR_RETURN(Scratch<bf16> copy, MakeScratch<bf16>(context, numel));
  TESSERA_RETURN_IF_ERROR(CastF32ToBf16(copy.get(), params, numel, context.stream()));
  return copy;
}

// The classifier's weight (wte [V, C], fp32) as bf16 [Vp, C], rows past the vocabulary zero:
// the head's GEMMs then run on the padded vocabulary (a multiple of 64), where cuBLASLt's
// tensor-core kernels apply; at V = 50257 they were 7x slower (bench_cuda_layers, H200). The
// zero rows make the padded logits 0, which the classifier ignores and overwrites with zeros.
Result<Scratch<bf16>> PaddedWteCopy(CudaContext& context, const float* wte, int64_t vocab,
                                    int64_t channels) {
  const int64_t padded = TiedLmHeadPaddedVocab(vocab);
  TESSERA_ASSIGN_OR_RETURN(Scratch<bf16> copy, MakeScratch<bf16>(context, padded * channels));
  TESSERA_RETURN_IF_ERROR(CastF32ToBf16(copy.get(), wte, vocab * channels, context.stream()));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      copy.get() + vocab * channels, 0,
      static_cast<size_t>((padded - vocab) * channels) * sizeof(bf16), context.stream()));
  return copy;
}

// A device int32 initialised to -1, for kernels that report the first bad id.
Result<Scratch<int32_t>> BadIndexFlag(CudaContext& context) {
  TESSERA_ASSIGN_OR_RETURN(Scratch<int32_t> flag, MakeScratch<int32_t>(context, 1));
  TESSERA_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(flag.get(), 0xFF, sizeof(int32_t), context.stream()));
  return flag;
}

// Waits for the flag and reads it.
Result<int32_t> ReadFlag(CudaContext& context, const Scratch<int32_t>& flag) {
  int32_t value = -1;
  TESSERA_RETURN_IF_ERROR(
      context.Copy(&value, Device::Cpu(), flag.get(), context.device(), sizeof(int32_t)));
  return value;
}

// Column sums of [rows, cols] bf16 into out (fp32, overwritten).
Status ColumnSums(CudaContext& context, float* out, const bf16* x, int64_t rows, int64_t cols) {
  TESSERA_ASSIGN_OR_RETURN(Scratch<float> scratch,
                           MakeScratch<float>(context, SumRowsScratch(rows, cols)));
  return SumRows(out, scratch.get(), x, rows, cols, /*accumulate=*/false, context.stream());
}

// The three gradients of a linear layer out = x W^T + b: dx (bf16, overwritten), dW, db (fp32).
Status LinearBackward(CudaContext& context, bf16* dx, float* dweight, float* dbias,
                      const bf16* dout, const bf16* x, const bf16* weight, int64_t rows,
                      int64_t in_features, int64_t out_features) {
  TESSERA_RETURN_IF_ERROR(LinearBackwardInput(context, dx, dout, weight, rows, in_features,
                                              out_features, out_features, false));
  TESSERA_RETURN_IF_ERROR(LinearBackwardWeight(context, dweight, dout, x, rows, in_features,
                                               out_features, out_features, false));
  return ColumnSums(context, dbias, dout, rows, out_features);
}

Status LayerNormBackwardInto(CudaContext& context, bf16* dx, float* dweight, float* dbias,
                             const bf16* dout, const bf16* x, const float* weight,
                             const float* mean, const float* rstd, int64_t rows, int64_t channels,
                             bool accumulate_dx) {
  TESSERA_ASSIGN_OR_RETURN(Scratch<float> scratch,
                           MakeScratch<float>(context, LayerNormBackwardScratch(rows, channels)));
  return LayerNormBackward(dx, dweight, dbias, scratch.get(), dout, x, weight, mean, rstd, rows,
                           channels, accumulate_dx, context.stream());
}

}  // namespace

Status TokenPositionEmbeddingForward(CudaContext& context, bf16* x, const int32_t* tokens,
                                     const float* emb_params, const TransformerDims& dims) {
  const FlatLayout layout =
      TokenPositionEmbeddingParamLayout(dims.vocab, dims.max_seq_len, dims.channels);
  FlatView<const float> p(emb_params, layout);
  TESSERA_ASSIGN_OR_RETURN(Scratch<int32_t> bad, BadIndexFlag(context));
  TESSERA_RETURN_IF_ERROR(EmbeddingForward(x, bad.get(), tokens, p["wte"], p["wpe"], dims.batch,
                                           dims.seq_len, dims.channels, dims.vocab,
                                           context.stream()));
  TESSERA_ASSIGN_OR_RETURN(int32_t first_bad, ReadFlag(context, bad));
  if (first_bad >= 0) {
    return InvalidArgument(
        "token at position {} (row {}, column {}) is outside the vocabulary "
        "of {}",
        first_bad, first_bad / dims.seq_len, first_bad % dims.seq_len, dims.vocab);
  }
  return Status::Ok();
}

Status TokenPositionEmbeddingBackward(CudaContext& context, float* demb, const bf16* dx,
                                      const int32_t* tokens, const TransformerDims& dims) {
  const FlatLayout layout =
      TokenPositionEmbeddingParamLayout(dims.vocab, dims.max_seq_len, dims.channels);
  FlatView<float> g(demb, layout);
  return EmbeddingBackward(g["wte"], g["wpe"], dx, tokens, dims.batch, dims.seq_len, dims.channels,
                           context.stream());
}

Status TransformerBlockForward(CudaContext& context, bf16* y, bf16* saved, const bf16* x,
                               const float* params, const TransformerDims& dims) {
  const int64_t n = dims.rows(), c = dims.channels;
  const cudaStream_t stream = context.stream();
  const FlatLayout param_layout = TransformerBlockParamLayout(c);
  const FlatLayout saved_layout =
      TransformerBlockSavedLayoutBf16(dims.batch, dims.seq_len, c, dims.heads);
  TESSERA_ASSIGN_OR_RETURN(Scratch<bf16> params_bf16,
                           Bf16Copy(context, params, param_layout.numel()));
  FlatView<const float> p32(params, param_layout);
  FlatView<const bf16> p(params_bf16.get(), param_layout);
  FlatView<bf16> s(saved, saved_layout);

  TESSERA_RETURN_IF_ERROR(LayerNormForward(s["ln1"], s.As<float>("ln1_mean"),
                                           s.As<float>("ln1_rstd"), x, p32["ln1_w"], p32["ln1_b"],
                                           n, c, stream));
  TESSERA_RETURN_IF_ERROR(LinearForward(context, s["qkv"], s["ln1"], p["qkv_w"], p["qkv_b"],
                                        nullptr, n, c, 3 * c, 3 * c));
  TESSERA_RETURN_IF_ERROR(AttentionForward(s["atty"], s.As<float>("lse"), s["qkv"], dims.batch,
                                           dims.seq_len, c, dims.heads, stream));
  TESSERA_RETURN_IF_ERROR(LinearForward(context, s["x_mid"], s["atty"], p["proj_w"], p["proj_b"],
                                        /*residual=*/x, n, c, c, c));
  TESSERA_RETURN_IF_ERROR(LayerNormForward(s["ln2"], s.As<float>("ln2_mean"),
                                           s.As<float>("ln2_rstd"), s["x_mid"], p32["ln2_w"],
                                           p32["ln2_b"], n, c, stream));
  TESSERA_RETURN_IF_ERROR(LinearForward(context, s["fch"], s["ln2"], p["fc_w"], p["fc_b"], nullptr,
                                        n, c, 4 * c, 4 * c));
  TESSERA_RETURN_IF_ERROR(GeluForward(s["fch_gelu"], s["fch"], n * 4 * c, stream));
  return LinearForward(context, y, s["fch_gelu"], p["fcproj_w"], p["fcproj_b"],
                       /*residual=*/s["x_mid"], n, 4 * c, c, c);
}

Status TransformerBlockBackward(CudaContext& context, bf16* d, float* dparams, const bf16* x,
                                const bf16* saved, const float* params,
                                const TransformerDims& dims) {
  const int64_t n = dims.rows(), c = dims.channels;
  const cudaStream_t stream = context.stream();
  const FlatLayout param_layout = TransformerBlockParamLayout(c);
  const FlatLayout saved_layout =
      TransformerBlockSavedLayoutBf16(dims.batch, dims.seq_len, c, dims.heads);
  TESSERA_ASSIGN_OR_RETURN(Scratch<bf16> params_bf16,
                           Bf16Copy(context, params, param_layout.numel()));
  FlatView<const float> p32(params, param_layout);
  FlatView<const bf16> p(params_bf16.get(), param_layout);
  FlatView<const bf16> s(saved, saved_layout);
  FlatView<float> g(dparams, param_layout);

  // Scratch: the MLP's hidden gradient [N,4C] (reused for the qkv gradient [N,3C]) and the
  // gradient entering a layernorm [N,C].
  TESSERA_ASSIGN_OR_RETURN(Scratch<bf16> hidden, MakeScratch<bf16>(context, n * 4 * c));
  TESSERA_ASSIGN_OR_RETURN(Scratch<bf16> ln_grad, MakeScratch<bf16>(context, n * c));

  // MLP branch: y = x_mid + fcproj(gelu(fc(ln2(x_mid)))). d = dL/dy = dL/dx_mid so far.
  TESSERA_RETURN_IF_ERROR(LinearBackward(context, hidden.get(), g["fcproj_w"], g["fcproj_b"], d,
                                         s["fch_gelu"], p["fcproj_w"], n, 4 * c, c));
  TESSERA_RETURN_IF_ERROR(GeluBackward(hidden.get(), hidden.get(), s["fch"], n * 4 * c, stream));
  TESSERA_RETURN_IF_ERROR(LinearBackward(context, ln_grad.get(), g["fc_w"], g["fc_b"], hidden.get(),
                                         s["ln2"], p["fc_w"], n, c, 4 * c));
  TESSERA_RETURN_IF_ERROR(LayerNormBackwardInto(
      context, d, g["ln2_w"], g["ln2_b"], ln_grad.get(), s["x_mid"], p32["ln2_w"],
      s.As<const float>("ln2_mean"), s.As<const float>("ln2_rstd"), n, c, /*accumulate_dx=*/true));

  // Attention branch: x_mid = x + proj(attention(qkv(ln1(x)))). d = dL/dx_mid now.
  bf16* datty = ln_grad.get();
  TESSERA_RETURN_IF_ERROR(
      LinearBackward(context, datty, g["proj_w"], g["proj_b"], d, s["atty"], p["proj_w"], n, c, c));
  bf16* dqkv = hidden.get();
  {
    TESSERA_ASSIGN_OR_RETURN(
        Scratch<char> attention_scratch,
        MakeScratch<char>(context,
                          AttentionBackwardScratch(dims.batch, dims.seq_len, c, dims.heads)));
    TESSERA_RETURN_IF_ERROR(AttentionBackward(dqkv, attention_scratch.get(), datty, s["atty"],
                                              s["qkv"], s.As<const float>("lse"), dims.batch,
                                              dims.seq_len, c, dims.heads, stream));
  }
  bf16* dln1 = ln_grad.get();
  TESSERA_RETURN_IF_ERROR(LinearBackward(context, dln1, g["qkv_w"], g["qkv_b"], dqkv, s["ln1"],
                                         p["qkv_w"], n, c, 3 * c));
  return LayerNormBackwardInto(context, d, g["ln1_w"], g["ln1_b"], dln1, x, p32["ln1_w"],
                               s.As<const float>("ln1_mean"), s.As<const float>("ln1_rstd"), n, c,
                               /*accumulate_dx=*/true);
}

Status TiedLmHeadForward(CudaContext& context, float* loss, bf16* saved, const bf16* x,
                         const float* head_params, const float* wte, const int32_t* targets,
                         const TransformerDims& dims, float grad_scale) {
  const int64_t n = dims.rows(), c = dims.channels, v = dims.vocab;
  const int64_t padded_v = TiedLmHeadPaddedVocab(v);
  const cudaStream_t stream = context.stream();
  const FlatLayout head_layout = TiedLmHeadParamLayout(c);
  const FlatLayout saved_layout = TiedLmHeadSavedLayoutBf16(dims.batch, dims.seq_len, c, v);
  FlatView<const float> p(head_params, head_layout);
  FlatView<bf16> s(saved, saved_layout);

  TESSERA_RETURN_IF_ERROR(LayerNormForward(s["lnf"], s.As<float>("lnf_mean"),
                                           s.As<float>("lnf_rstd"), x, p["lnf_w"], p["lnf_b"], n, c,
                                           stream));
  {
    TESSERA_ASSIGN_OR_RETURN(Scratch<bf16> wte_bf16, PaddedWteCopy(context, wte, v, c));
    TESSERA_RETURN_IF_ERROR(LinearForward(context, s["dlogits"], s["lnf"], wte_bf16.get(), nullptr,
                                          nullptr, n, c, padded_v, padded_v));
  }
  TESSERA_ASSIGN_OR_RETURN(Scratch<int32_t> bad, BadIndexFlag(context));
  TESSERA_RETURN_IF_ERROR(SoftmaxCrossEntropy(s["dlogits"], s.As<float>("losses"), bad.get(),
                                              targets, n, v, padded_v, grad_scale,
                                              /*write_gradient=*/true, stream));
  TESSERA_RETURN_IF_ERROR(Mean(loss, s.As<float>("losses"), n, stream));
  TESSERA_ASSIGN_OR_RETURN(int32_t first_bad, ReadFlag(context, bad));
  if (first_bad >= 0) {
    return InvalidArgument(
        "target at position {} (row {}, column {}) is outside the vocabulary "
        "of {}",
        first_bad, first_bad / dims.seq_len, first_bad % dims.seq_len, v);
  }
  return Status::Ok();
}

Status TiedLmHeadBackward(CudaContext& context, bf16* dx, float* dhead, float* demb, const bf16* x,
                          const bf16* saved, const float* head_params, const float* wte,
                          const TransformerDims& dims) {
  const int64_t n = dims.rows(), c = dims.channels, v = dims.vocab;
  const int64_t padded_v = TiedLmHeadPaddedVocab(v);
  const FlatLayout head_layout = TiedLmHeadParamLayout(c);
  const FlatLayout saved_layout = TiedLmHeadSavedLayoutBf16(dims.batch, dims.seq_len, c, v);
  const FlatLayout emb_layout = TokenPositionEmbeddingParamLayout(v, dims.max_seq_len, c);
  FlatView<const float> p(head_params, head_layout);
  FlatView<const bf16> s(saved, saved_layout);
  FlatView<float> g(dhead, head_layout);
  FlatView<float> ge(demb, emb_layout);

  TESSERA_ASSIGN_OR_RETURN(Scratch<bf16> dlnf, MakeScratch<bf16>(context, n * c));
  {
    // logits = lnf @ wte^T: dlnf = dlogits @ wte, dwte = dlogits^T @ lnf.
    // On the padded vocabulary (PaddedWteCopy): dlogits' padded columns are zeros, so the
    // padded rows add nothing to dlnf, and their dwte rows (zeros) are dropped.
    TESSERA_ASSIGN_OR_RETURN(Scratch<bf16> wte_bf16, PaddedWteCopy(context, wte, v, c));
    TESSERA_RETURN_IF_ERROR(LinearBackwardInput(context, dlnf.get(), s["dlogits"], wte_bf16.get(),
                                                n, c, padded_v, padded_v, false));
    TESSERA_ASSIGN_OR_RETURN(Scratch<float> dwte, MakeScratch<float>(context, padded_v * c));
    TESSERA_RETURN_IF_ERROR(LinearBackwardWeight(context, dwte.get(), s["dlogits"], s["lnf"], n, c,
                                                 padded_v, padded_v, false));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ge["wte"], dwte.get(),
                                                 static_cast<size_t>(v * c) * sizeof(float),
                                                 cudaMemcpyDeviceToDevice, context.stream()));
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      ge["wpe"], 0, static_cast<size_t>(dims.max_seq_len * c) * sizeof(float), context.stream()));
  return LayerNormBackwardInto(context, dx, g["lnf_w"], g["lnf_b"], dlnf.get(), x, p["lnf_w"],
                               s.As<const float>("lnf_mean"), s.As<const float>("lnf_rstd"), n, c,
                               /*accumulate_dx=*/false);
}

Status TiedLmHeadLogits(CudaContext& context, float* logits, const bf16* x,
                        const float* head_params, const float* wte, const TransformerDims& dims) {
  const int64_t n = dims.rows(), c = dims.channels, v = dims.vocab;
  const int64_t padded_v = TiedLmHeadPaddedVocab(v);
  const FlatLayout head_layout = TiedLmHeadParamLayout(c);
  FlatView<const float> p(head_params, head_layout);
  TESSERA_ASSIGN_OR_RETURN(Scratch<bf16> lnf, MakeScratch<bf16>(context, n * c));
  TESSERA_ASSIGN_OR_RETURN(Scratch<float> stats, MakeScratch<float>(context, 2 * n));
  TESSERA_RETURN_IF_ERROR(LayerNormForward(lnf.get(), stats.get(), stats.get() + n, x, p["lnf_w"],
                                           p["lnf_b"], n, c, context.stream()));
  TESSERA_ASSIGN_OR_RETURN(Scratch<bf16> wte_bf16, PaddedWteCopy(context, wte, v, c));
  TESSERA_ASSIGN_OR_RETURN(Scratch<bf16> padded, MakeScratch<bf16>(context, n * padded_v));
  TESSERA_RETURN_IF_ERROR(LinearForward(context, padded.get(), lnf.get(), wte_bf16.get(), nullptr,
                                        nullptr, n, c, padded_v, padded_v));
  return CastRowsBf16ToF32(logits, padded.get(), n, v, padded_v, context.stream());
}

}  // namespace tessera::cuda
