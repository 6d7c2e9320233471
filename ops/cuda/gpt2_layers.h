// GPT-2 layers on a GPU: the whole-layer forward and backward of ops/cpu/gpt2_layers.h, composed
// from the CUDA kernels (kernels.h) and cuBLASLt GEMMs (matmul.h), on a CudaContext's stream.
//
// Numerics (the mixed precision of llm.c and of PyTorch's bf16 autocast): parameters arrive as
// the fp32 master copy and are cast to bf16 once per call for the GEMMs (layernorm gains and
// biases of the normalisations are read in fp32); activations, the residual stream included,
// are bf16; every GEMM and reduction accumulates in fp32; parameter gradients are written in
// fp32 straight from the GEMMs' fp32 accumulators. Saved activations use the bf16 layouts of
// ops/flat_layout.h (Gpt2BlockSavedLayoutBf16, Gpt2HeadSavedLayoutBf16).
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

using Gpt2Dims = tessera::Gpt2Dims;

// x[B,T,C] = wte[tokens] + wpe[0..T). emb_params: the embedding layout (fp32).
Status Gpt2EmbeddingForward(CudaContext& context, bf16* x, const int32_t* tokens,
                            const float* emb_params, const Gpt2Dims& dims);
// demb (embedding layout, fp32) accumulates dx scattered by token and position.
Status Gpt2EmbeddingBackward(CudaContext& context, float* demb, const bf16* dx,
                             const int32_t* tokens, const Gpt2Dims& dims);

// y[B,T,C] = block(x); saved: Gpt2BlockSavedLayoutBf16.
Status Gpt2BlockForward(CudaContext& context, bf16* y, bf16* saved, const bf16* x,
                        const float* params, const Gpt2Dims& dims);
// On entry d holds dL/dy, on exit dL/dx; dparams (block layout, fp32) is overwritten.
Status Gpt2BlockBackward(CudaContext& context, bf16* d, float* dparams, const bf16* x,
                         const bf16* saved, const float* params, const Gpt2Dims& dims);

// lnf, logits = lnf @ wte^T and the fused classifier, leaving (softmax - onehot) * grad_scale / N
// in saved's dlogits and the mean loss in *loss (a device scalar). saved: Gpt2HeadSavedLayoutBf16.
Status Gpt2HeadForward(CudaContext& context, float* loss, bf16* saved, const bf16* x,
                       const float* head_params, const float* wte, const int32_t* targets,
                       const Gpt2Dims& dims, float grad_scale);
// dx (overwritten), dhead (head layout, overwritten), demb (embedding layout, overwritten: wte
// gets dlogits^T lnf, wpe zeros).
Status Gpt2HeadBackward(CudaContext& context, bf16* dx, float* dhead, float* demb, const bf16* x,
                        const bf16* saved, const float* head_params, const float* wte,
                        const Gpt2Dims& dims);

// logits [B*T, V] (fp32) for inference: lnf, then lnf @ wte^T (bf16 GEMM, fp32 accumulation).
Status Gpt2HeadLogits(CudaContext& context, float* logits, const bf16* x, const float* head_params,
                      const float* wte, const Gpt2Dims& dims);

}  // namespace tessera::cuda
