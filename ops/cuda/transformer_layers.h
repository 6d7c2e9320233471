// Transformer layers on a GPU: the whole-layer forward and backward of
// ops/cpu/transformer_layers.h, composed from the CUDA kernels (kernels.h) and cuBLASLt GEMMs
// (matmul.h), on a CudaContext's stream.
//
// Numerics (the mixed precision of PyTorch's bf16 autocast): parameters arrive as
// the fp32 master copy and are cast to bf16 once per call for the GEMMs (layernorm gains and
// biases of the normalisations are read in fp32); activations, the residual stream included,
// are bf16; every GEMM and reduction accumulates in fp32; parameter gradients are written in
// fp32 straight from the GEMMs' fp32 accumulators. Saved activations use the bf16 layouts of
// ops/flat_layout.h (TransformerBlockSavedLayoutBf16, TiedLmHeadSavedLayoutBf16).
//
// Every function enqueues its work and returns; scratch comes from the context's allocator and
// goes back behind the enqueued work. The two that validate ids (the embedding's tokens, the
// head's targets) wait for their kernel to report, so a bad id is an InvalidArgument naming it,
// not silent garbage.
#pragma once

#include <cstdint>

#include "core/status.h"
#include "ops/cuda/cuda_context.h"
#include "ops/cuda/kernels.h"
#include "ops/flat_layout.h"

namespace tessera::cuda {

using TransformerDims = tessera::TransformerDims;

// x[B,T,C] = wte[tokens] + wpe[0..T). emb_params: the embedding layout (fp32).
Status TokenPositionEmbeddingForward(CudaContext& context, bf16* x, const int32_t* tokens,
                                     const float* emb_params, const TransformerDims& dims);
// demb (embedding layout, fp32) accumulates dx scattered by token and position.
Status TokenPositionEmbeddingBackward(CudaContext& context, float* demb, const bf16* dx,
                                      const int32_t* tokens, const TransformerDims& dims);

// y[B,T,C] = block(x); saved: TransformerBlockSavedLayoutBf16.
Status TransformerBlockForward(CudaContext& context, bf16* y, bf16* saved, const bf16* x,
                               const float* params, const TransformerDims& dims);
// On entry d holds dL/dy, on exit dL/dx; dparams (block layout, fp32) is overwritten.
Status TransformerBlockBackward(CudaContext& context, bf16* d, float* dparams, const bf16* x,
                                const bf16* saved, const float* params,
                                const TransformerDims& dims);

// lnf, logits = lnf @ wte^T and the fused classifier, leaving (softmax - onehot) * grad_scale / N
// in saved's dlogits and the mean loss in *loss (a device scalar). saved:
// TiedLmHeadSavedLayoutBf16.
Status TiedLmHeadForward(CudaContext& context, float* loss, bf16* saved, const bf16* x,
                         const float* head_params, const float* wte, const int32_t* targets,
                         const TransformerDims& dims, float grad_scale);
// dx (overwritten), dhead (head layout, overwritten), demb (embedding layout, overwritten: wte
// gets dlogits^T lnf, wpe zeros).
Status TiedLmHeadBackward(CudaContext& context, bf16* dx, float* dhead, float* demb, const bf16* x,
                          const bf16* saved, const float* head_params, const float* wte,
                          const TransformerDims& dims);

// logits [B*T, V] (fp32) for inference: lnf, then lnf @ wte^T (bf16 GEMM, fp32 accumulation).
Status TiedLmHeadLogits(CudaContext& context, float* logits, const bf16* x,
                        const float* head_params, const float* wte, const TransformerDims& dims);

}  // namespace tessera::cuda
