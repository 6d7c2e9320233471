// The definitions (shape inference, cost, in-place pairs) of Tessera's built-in ops. Kernels are
// registered separately per device (ops/cpu/cpu_kernels.h), so a planner or scheduler can link
// this without any kernel code.
//
// Primitive ops, each a forward and a backward (unit-tested against finite differences):
//   embedding_forward/backward, layernorm_forward/backward, linear_forward/backward,
//   matmul_forward/backward, attention_forward/backward, gelu_forward/backward,
//   add_forward/backward, softmax_cross_entropy (loss and its gradient in one pass),
//   adamw (param_offset: a shard's update inside a full group), sgd, sum_of_squares,
//   clip_scale, sum_scalars, accumulate (in-place add); noop (an empty task, for runtime overheads)
//   and sleep (waits, then copies its input: for failure-handling tests).
// Collective members (attributes in core/collective_task.h; run by a worker's communicator, or
// by the CPU kernels when the group has one member):
//   all_reduce (attribute reduce = sum|avg|max|min), reduce_scatter (reduce), all_gather,
//   all_gather_in_place, broadcast (root). Inputs after `x` are control inputs (ordering only).
// GPT-2 layer ops (what a step graph's tasks run, one task per layer per direction):
//   gpt2_embedding_forward/backward, gpt2_block_forward/backward, gpt2_head_forward/backward,
//   gpt2_head_logits.
// 3D U-Net ops on NCDHW volumes (conv3d, conv_transpose3d, upsample_nearest3d, max_pool3d,
// group_norm, relu, silu, concat, voxel_cross_entropy, dice_score): ops/volume_ops.h.
//
// Attribute names used by several ops:
//   channels, heads, vocab, max_seq_len   GPT-2 dimensions
//   grad_scale                            multiplies the loss's gradient (1/K for K-way
//                                         gradient accumulation)
//   beta1, beta2, eps, weight_decay       AdamW; decay_ranges = [begin, end, ...) element pairs
//                                         of the group that take weight decay (absent: all);
//                                         element_offset = index of the group's first element
//   max_norm                              clip_scale: global gradient-norm bound (<= 0: none)
//   param_multiple                        GPT-2 layer ops: parameter groups are padded to a
//                                         multiple of it (ZeRO shards); padding reads as
//                                         nothing and gradients there are zero
//   activation_dtype                      GPT-2 layer ops: "f32" (default) or "bf16" (GPU):
//                                         the type of x, dx and the saved activations
//                                         (flat_layout.h's *Bf16 layouts)
#pragma once

#include "core/status.h"
#include "ops/op_registry.h"

namespace tessera {

inline constexpr const char* kParamMultipleAttr = "param_multiple";
inline constexpr const char* kActivationDTypeAttr = "activation_dtype";

// Adds every built-in op definition. AlreadyExists if called twice on one registry.
Status RegisterStandardOps(OpRegistry& registry);

}  // namespace tessera
