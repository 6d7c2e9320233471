// The definitions (shape inference, cost, in-place pairs) of Tessera's built-in ops. Kernels are
// registered separately per device (ops/cpu/cpu_kernels.h), so a planner or scheduler can link
// this without any kernel code.
//
// Primitive ops, each a forward and a backward (unit-tested against finite differences):
//   embedding_forward/backward, layernorm_forward/backward, linear_forward/backward,
//   matmul_forward/backward, attention_forward/backward, gelu_forward/backward,
//   add_forward/backward, softmax_cross_entropy (loss and its gradient in one pass),
//   adamw (param_offset: a shard's update inside a full group), onebit_adam (1-bit Adam's
//   warm-up) and onebit_adam_momentum / onebit_adam_frozen (its compressed phase),
//   zero_one_adam_compressed / zero_one_adam_local / zero_one_adam_sync (0/1 Adam's steps), sgd,
//   scale (in place, by a scalar input), sum_of_squares, clip_scale, sum_scalars, accumulate
//   (in-place add; f32, or bf16 added in f32: a bf16 activation's gradients from its readers),
//   loss_gradient (dlogits, f32 or bf16, times the loss's gradient); noop (an empty task, for
//   runtime overheads) and sleep (waits, then copies its input: for failure-handling tests).
// Collective members (attributes in core/collective_task.h; run by a worker's communicator, or
// by the CPU kernels when the group has one member):
//   all_reduce (attribute reduce = sum|avg|max|min), reduce_scatter (reduce), all_gather,
//   all_gather_in_place, all_to_all, broadcast (root). Inputs after `x` are control inputs
//   (ordering only). compressed_all_reduce (x, worker_error, server_error; every one updated in
//   place; control inputs after them): 1-bit Adam's average sent as signs with error feedback.
// Transformer layer ops: whole layers over flat parameter groups (ops/flat_layout.h) with a
// hand-fused backward, what a step graph's tasks run for a decoder-only language model (one task
// per layer per direction):
//   token_position_embedding_forward/backward  x = wte[tokens] + wpe[positions]; the backward adds
//                                              to the tied classifier's wte gradient in place
//   transformer_block_forward/backward         a pre-LayerNorm causal transformer block with a
//                                              GELU (tanh) MLP: x + attn(ln1(x)), then
//                                              + fcproj(gelu(fc(ln2(.)))); the backward also in
//                                              two halves, _backward_input and _backward_weight,
//                                              for zero-bubble pipelines
//   tied_lm_head_forward/backward              final layernorm, a classifier tied to the
//                                              embedding's wte, and fused softmax cross-entropy
//   tied_lm_head_logits                        final layernorm and the tied classifier: logits
// Tensor-parallel ops (vocabulary-parallel embedding and cross-entropy, Megatron-LM's; attribute
// tensor_rank, set by the planner on a split layer's tasks):
//   vocab_shard_embedding_forward/backward     a rank's rows of wte looked up (zeros elsewhere)
//   position_add_forward/backward              x + wpe[positions]
//   vocab_shard_logit_stats(_backward)         a rank's logits [R, V/T] as [R, T+1] statistics
//   cross_entropy_from_stats(_backward)        the loss from the statistics summed over ranks
//   heads_to_chunks, chunks_to_heads           sequence parallelism (Ulysses): heads as the
//                                              all-to-all's blocks, and back
//   heads_linear_forward/backward              a linear over such blocks' heads, read in place
// Volume ops on NCDHW tensors (conv3d, conv_transpose3d, upsample_nearest3d, max_pool3d,
// group_norm, relu, silu, concat, voxel_cross_entropy, dice_score): ops/volume_ops.h.
//
// Attribute names used by several ops:
//   channels, heads, vocab, max_seq_len   transformer layer dimensions
//   grad_scale                            multiplies the loss's gradient (1/K for K-way
//                                         gradient accumulation)
//   beta1, beta2, eps, weight_decay       AdamW; decay_ranges = [begin, end, ...) element pairs
//                                         of the group that take weight decay (absent: all);
//                                         element_offset = index of the group's first element
//   max_norm                              clip_scale: global gradient-norm bound (<= 0: none)
//   param_multiple                        transformer layer ops: parameter groups are padded to a
//                                         multiple of it (ZeRO shards); padding reads as
//                                         nothing and gradients there are zero
//   activation_dtype                      transformer layer ops: "f32" (default) or "bf16" (GPU):
//                                         the type of x, dx and the saved activations
//                                         (flat_layout.h's *Bf16 layouts)
//   rebuild                               transformer_block_forward and _backward (the whole
//                                         one; f32): what the backward recomputes instead of
//                                         the forward saving it, "norms_gelu" or
//                                         "norms_gelu_attention" (flat_layout.h BlockRebuild);
//                                         absent or "": nothing. Both ops must agree.
#pragma once

#include "core/status.h"
#include "ops/op_registry.h"

namespace tessera {

inline constexpr const char* kParamMultipleAttr = "param_multiple";
inline constexpr const char* kActivationDTypeAttr = "activation_dtype";
inline constexpr const char* kRebuildAttr = "rebuild";
// A split layer's tensor rank (0 .. T-1): set by the planner on the tasks of a tensor-parallel
// layer; a layer program hands it to each of its ops (the vocabulary-parallel ops read it).
inline constexpr const char* kTensorRankAttr = "tensor_rank";
// A sequence-parallel rank (0 .. P-1, DeepSpeed-Ulysses): set by the planner on every layer task
// of a sequence-parallel plan and handed on likewise (position_add reads it: its positions start
// at sequence_rank x its sequence length).
inline constexpr const char* kSequenceRankAttr = "sequence_rank";
// Ring attention: attention_block_forward's attribute ring_step k (with attribute ranks P) says
// its keys and values are those k rotations brought (core/exchange_layout.h's kRingNext): the
// block sequence rank (r - k) mod P made, r being the task's sequence_rank.
inline constexpr const char* kRingStepAttr = "ring_step";

// attention_block_forward's key offset (where key 0 sits against query 0): attribute
// key_offset, or under kRingStepAttr ((r - k) mod P - r) x `keys` (the block's positions against
// the rank's own, every shard `keys` long). 0 when neither is given.
int64_t AttentionBlockKeyOffset(const Attrs& attrs, int64_t keys);

// Adds every built-in op definition, then the ops of every plugin this process loaded
// (ops/plugin.h). AlreadyExists if called twice on one registry.
Status RegisterStandardOps(OpRegistry& registry);

}  // namespace tessera
