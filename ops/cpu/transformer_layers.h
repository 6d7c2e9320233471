// Transformer layer kernels on the CPU: the whole-layer forward and backward of a decoder-only
// language model's layers (token + position embedding; a pre-LayerNorm causal transformer block
// with a GELU MLP; final layernorm, a classifier tied to the embedding and fused softmax
// cross-entropy), composed from the primitive kernels, over flat parameter and saved-activation
// buffers (layouts in ops/flat_layout.h).
//
// These are what a step graph's tasks run: one task per layer per direction. Each function
// documents what it reads and writes; none allocates except small per-call workspaces.
#pragma once

#include <cstdint>

#include "core/status.h"
#include "ops/flat_layout.h"

namespace tessera::cpu {

using TransformerDims = tessera::TransformerDims;

// x[B,T,C] = wte[tokens] + wpe[0..T). emb_params: the embedding layout. InvalidArgument on a
// token outside the vocabulary.
Status TokenPositionEmbeddingForward(float* x, const int32_t* tokens, const float* emb_params,
                                     const TransformerDims& dims);
// demb (embedding layout) accumulates dx scattered by token and position. On entry it holds the
// classifier's part of the tied wte gradient (and zeros for wpe).
void TokenPositionEmbeddingBackward(float* demb, const float* dx, const int32_t* tokens,
                                    const TransformerDims& dims);

// y[B,T,C] = block(x); saved: the block saved layout (less what dims.rebuild leaves to the
// backward); workspace: TransformerBlockForwardWorkspace(dims) floats (ops/flat_layout.h) (none
// when it rebuilds nothing: may then be null).
void TransformerBlockForward(float* y, float* saved, float* workspace, const float* x,
                             const float* params, const TransformerDims& dims,
                             int64_t split_min_flops);
// On entry d holds dL/dy; on exit dL/dx (computed in place: the residual stream's gradient
// flows through unchanged and the branches add to it). dparams (block layout) is overwritten.
// workspace: TransformerBlockBackwardWorkspace(dims) floats (with room for what dims.rebuild
// recomputes first).
void TransformerBlockBackward(float* d, float* dparams, float* workspace, const float* x,
                              const float* saved, const float* params, const TransformerDims& dims,
                              int64_t split_min_flops);
// The same backward in two halves, for zero-bubble pipelines (the weight gradients wait while the
// input gradient goes on to the previous stage). Input: d as above (dL/dy in, dL/dx out) and
// `stash` (TransformerBlockStashLayout, overwritten) with what Weight needs; workspace:
// TransformerBlockInputWorkspace(dims) floats. Weight: dparams (block layout, overwritten) from the
// stash and the saved activations. Input then Weight compute what TransformerBlockBackward
// computes, bit for bit (it is made of them). REQUIRES: dims.rebuild is kNothing.
void TransformerBlockBackwardInput(float* d, float* stash, float* workspace, const float* x,
                                   const float* saved, const float* params,
                                   const TransformerDims& dims, int64_t split_min_flops);
void TransformerBlockBackwardWeight(float* dparams, const float* stash, const float* saved,
                                    const TransformerDims& dims, int64_t split_min_flops);

// Training forward of the head: lnf, logits = lnf @ wte^T, and the fused classifier, leaving the
// loss's gradient w.r.t. the logits (times grad_scale) in saved's "dlogits". Returns the mean
// loss. InvalidArgument on a target outside the vocabulary.
Result<float> TiedLmHeadForward(float* saved, const float* x, const float* head_params,
                                const float* wte, const int32_t* targets,
                                const TransformerDims& dims, float grad_scale,
                                int64_t split_min_flops);
// dx (overwritten), dhead (head layout, overwritten), demb (embedding layout, overwritten: the
// wte part gets dlogits^T lnf, the wpe part zeros). workspace: TiedLmHeadWorkspace(dims) floats.
void TiedLmHeadBackward(float* dx, float* dhead, float* demb, float* workspace, const float* x,
                        const float* saved, const float* head_params, const float* wte,
                        const TransformerDims& dims, int64_t split_min_flops);
// logits[B,T,V] for inference; workspace: TiedLmHeadWorkspace(dims) floats.
void TiedLmHeadLogits(float* logits, float* workspace, const float* x, const float* head_params,
                      const float* wte, const TransformerDims& dims, int64_t split_min_flops);

}  // namespace tessera::cpu
