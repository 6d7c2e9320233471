// FlatLayout: named tensors packed back to back in one flat f32 buffer.
//
// Tessera keeps each layer's parameters as one flat object (so a ZeRO planner can shard a layer
// by slicing, and an optimizer task updates a whole group in one pass), and each layer's saved
// activations as another. A FlatLayout says where each named tensor sits inside such a buffer.
// Layouts are pure functions of model dimensions, so shape inference, kernels, the planner and
// checkpoint code all compute the same one independently.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace tessera {

struct FlatSlot {
  std::string name;
  Shape shape;
  int64_t offset = 0;         // in elements from the start of the buffer
  bool weight_decay = false;  // for parameter layouts: does AdamW decay this tensor
};

class FlatLayout {
 public:
  // Appends a tensor; returns its offset.
  int64_t Add(std::string name, Shape shape, bool weight_decay = false);

  int64_t numel() const { return numel_; }
  const std::vector<FlatSlot>& slots() const { return slots_; }
  // REQUIRES: the layout has a slot of that name (layouts are fixed by code, so a miss is a bug).
  const FlatSlot& slot(std::string_view name) const;
  int64_t offset(std::string_view name) const { return slot(name).offset; }
  // NotFound otherwise.
  Result<const FlatSlot*> Find(std::string_view name) const;

  // [start, end) element ranges of the weight-decayed slots, merged where adjacent.
  std::vector<int64_t> DecayRanges() const;

 private:
  std::vector<FlatSlot> slots_;
  int64_t numel_ = 0;
};

// Typed pointers to the named slots of a flat buffer laid out by `layout` (which must outlive
// the view). As<U> reads a slot as another element type (a bf16 layout's fp32 slots).
template <typename T>
class FlatView {
 public:
  FlatView(T* base, const FlatLayout& layout) : base_(base), layout_(layout) {}
  T* operator[](std::string_view name) const { return base_ + layout_.offset(name); }
  template <typename U>
  U* As(std::string_view name) const {
    return reinterpret_cast<U*>(base_ + layout_.offset(name));
  }

 private:
  T* base_;
  const FlatLayout& layout_;
};

// A group of `numel` elements padded to a multiple of `multiple` (>= 1): equal ZeRO shards.
inline int64_t PaddedNumel(int64_t numel, int64_t multiple) {
  return (numel + multiple - 1) / multiple * multiple;
}

// What a transformer block's backward recomputes instead of reading it from what its forward
// saved (attribute "rebuild" of the block's forward and backward ops; ops/standard_ops.h). Each
// level trades backward work for saved bytes, per token of 15C floats saved in full:
//   kNothing            (absent or "")             everything below is saved
//   kNormsAndGelu       ("norms_gelu")             ln1 and ln2 (with their means and rstds) and
//                                                  fch_gelu are recomputed from x, x_mid and fch:
//                                                  elementwise work; 9C kept
//   kNormsGeluAttention ("norms_gelu_attention")   also attention's output, its lse and x_mid:
//                                                  attention's forward and the projection again;
//                                                  7C kept (qkv and fch)
// The recomputed values equal the forward's bit for bit (the same kernels on the same inputs).
enum class BlockRebuild : uint8_t { kNothing, kNormsAndGelu, kNormsGeluAttention };
const char* BlockRebuildName(BlockRebuild rebuild);  // "" for kNothing
// InvalidArgument naming the choices for anything else.
Result<BlockRebuild> ParseBlockRebuild(std::string_view name);

// A transformer layer's dimensions as its kernels take them (ops/cpu and ops/cuda
// transformer_layers.h).
struct TransformerDims {
  int64_t batch = 0;
  int64_t seq_len = 0;
  int64_t channels = 0;
  int64_t heads = 0;
  int64_t vocab = 0;
  int64_t max_seq_len = 0;
  BlockRebuild rebuild = BlockRebuild::kNothing;  // the block's: what its backward recomputes
  int64_t rows() const { return batch * seq_len; }
};

// The transformer layers' parameter groups (a decoder-only language model with learned position
// embeddings, pre-LayerNorm blocks and a classifier tied to the token embedding):
//   embedding: wte [V, C], wpe [max_T, C]
//   block:     ln1_w ln1_b [C], qkv_w [3C, C], qkv_b [3C], proj_w [C, C], proj_b [C],
//              ln2_w ln2_b [C], fc_w [4C, C], fc_b [4C], fcproj_w [C, 4C], fcproj_b [C]
//   head:      lnf_w lnf_b [C]   (the classifier weight is the embedding's wte)
// Weight decay applies to matrices (rank 2), never to biases or layernorm gains.
FlatLayout TokenPositionEmbeddingParamLayout(int64_t vocab, int64_t max_seq_len, int64_t channels);
FlatLayout TransformerBlockParamLayout(int64_t channels);
FlatLayout TiedLmHeadParamLayout(int64_t channels);

// What a block's forward keeps for its backward, for a batch of B x T tokens:
//   ln1 [B,T,C], ln1_mean, ln1_rstd [B*T], qkv [B,T,3C], atty [B,T,C], lse [B,NH,T],
//   x_mid [B,T,C] (residual after attention), ln2 [B,T,C], ln2_mean, ln2_rstd [B*T],
//   fch [B,T,4C] (before GELU), fch_gelu [B,T,4C]
// less the slots its backward rebuilds; TransformerBlockRebuiltLayout holds those (scratch space
// of the forward and the backward), in the same order.
FlatLayout TransformerBlockSavedLayout(int64_t batch, int64_t seq_len, int64_t channels,
                                       int64_t heads,
                                       BlockRebuild rebuild = BlockRebuild::kNothing);
FlatLayout TransformerBlockRebuiltLayout(int64_t batch, int64_t seq_len, int64_t channels,
                                         int64_t heads, BlockRebuild rebuild);
// What the head's forward keeps: lnf [B,T,C], lnf_mean, lnf_rstd [B*T], and dlogits [B*T, V]
// (the gradient of the loss w.r.t. the logits, computed in the forward by the fused classifier).
FlatLayout TiedLmHeadSavedLayout(int64_t batch, int64_t seq_len, int64_t channels, int64_t vocab);
// What a block's split backward (zero-bubble pipelines) hands from its input-gradient half to its
// weight-gradient half: the gradients entering its four linears, dfcproj [B,T,C] (dL/dy), dfc
// [B,T,4C] (after GELU's backward), dproj [B,T,C] (dL/dx_mid), dqkv [B,T,3C], and the two
// layernorms' parameter gradients ln2_w, ln2_b, ln1_w, ln1_b [C] (cheap: computed with dx).
FlatLayout TransformerBlockStashLayout(int64_t batch, int64_t seq_len, int64_t channels);

// The scratch the CPU kernels take (floats, KernelContext::allocator; the memory model counts it
// through OpDef::workspace): the block's forward, what dims.rebuild leaves to the backward; its
// whole backward, the stash, the input half's scratch and what it rebuilds; its input half, one
// [B,T,C] buffer; the head's backward and logits, [B*T, C + 2] (the final layernorm's output and
// statistics again).
int64_t TransformerBlockForwardWorkspace(const TransformerDims& dims);
int64_t TransformerBlockBackwardWorkspace(const TransformerDims& dims);
int64_t TransformerBlockInputWorkspace(const TransformerDims& dims);
int64_t TiedLmHeadWorkspace(const TransformerDims& dims);

// The same on a GPU, where activations are bf16 (attribute activation_dtype = "bf16"): a flat
// bf16 buffer with the same slot names. Slots kept in fp32 (the layernorm means and rstds, the
// attention lse, the head's per-row losses) take two bf16 elements per value, and every slot
// starts at a multiple of kGpuSlotAlignment elements (128 bytes) so kernels may use 16-byte
// vector accesses. The head's dlogits rows are TiedLmHeadPaddedVocab(vocab) wide (columns past the
// vocabulary hold zeros), and it keeps the per-row losses ("losses", fp32 [B*T]).
inline constexpr int64_t kGpuSlotAlignment = 64;
FlatLayout TransformerBlockSavedLayoutBf16(int64_t batch, int64_t seq_len, int64_t channels,
                                           int64_t heads);
FlatLayout TiedLmHeadSavedLayoutBf16(int64_t batch, int64_t seq_len, int64_t channels,
                                     int64_t vocab);
// The vocabulary rounded up to a multiple of 64 (50257 -> 50304): a tensor-core size.
inline int64_t TiedLmHeadPaddedVocab(int64_t vocab) { return PaddedNumel(vocab, 64); }

}  // namespace tessera
