#include "ops/flat_layout.h"

namespace tessera {

int64_t FlatLayout::Add(std::string name, Shape shape, bool weight_decay) {
  const int64_t offset = numel_;
  numel_ += shape.numel();
  slots_.push_back(FlatSlot{std::move(name), std::move(shape), offset, weight_decay});
  return offset;
}

Result<const FlatSlot*> FlatLayout::Find(std::string_view name) const {
  for (const FlatSlot& slot : slots_) {
    if (slot.name == name) return &slot;
  }
  return NotFound("layout has no tensor named '{}'", name);
}

const FlatSlot& FlatLayout::slot(std::string_view name) const {
  Result<const FlatSlot*> found = Find(name);
  TESSERA_CHECK(found.ok(), "{}", found.status().ToString());
  return **found;
}

std::vector<int64_t> FlatLayout::DecayRanges() const {
  std::vector<int64_t> ranges;
  for (const FlatSlot& slot : slots_) {
    if (!slot.weight_decay) continue;
    const int64_t end = slot.offset + slot.shape.numel();
    if (!ranges.empty() && ranges.back() == slot.offset) {
      ranges.back() = end;
    } else {
      ranges.push_back(slot.offset);
      ranges.push_back(end);
    }
  }
  return ranges;
}

FlatLayout TokenPositionEmbeddingParamLayout(int64_t vocab, int64_t max_seq_len, int64_t channels) {
  FlatLayout layout;
  layout.Add("wte", {vocab, channels}, /*weight_decay=*/true);
  layout.Add("wpe", {max_seq_len, channels}, /*weight_decay=*/true);
  return layout;
}

FlatLayout TransformerBlockParamLayout(int64_t channels) {
  const int64_t c = channels;
  FlatLayout layout;
  layout.Add("ln1_w", {c});
  layout.Add("ln1_b", {c});
  layout.Add("qkv_w", {3 * c, c}, true);
  layout.Add("qkv_b", {3 * c});
  layout.Add("proj_w", {c, c}, true);
  layout.Add("proj_b", {c});
  layout.Add("ln2_w", {c});
  layout.Add("ln2_b", {c});
  layout.Add("fc_w", {4 * c, c}, true);
  layout.Add("fc_b", {4 * c});
  layout.Add("fcproj_w", {c, 4 * c}, true);
  layout.Add("fcproj_b", {c});
  return layout;
}

FlatLayout TiedLmHeadParamLayout(int64_t channels) {
  FlatLayout layout;
  layout.Add("lnf_w", {channels});
  layout.Add("lnf_b", {channels});
  return layout;
}

const char* BlockRebuildName(BlockRebuild rebuild) {
  switch (rebuild) {
    case BlockRebuild::kNothing:
      return "";
    case BlockRebuild::kNormsAndGelu:
      return "norms_gelu";
    case BlockRebuild::kNormsGeluAttention:
      return "norms_gelu_attention";
  }
  return "?";
}

Result<BlockRebuild> ParseBlockRebuild(std::string_view name) {
  for (BlockRebuild rebuild :
       {BlockRebuild::kNothing, BlockRebuild::kNormsAndGelu, BlockRebuild::kNormsGeluAttention}) {
    if (name == BlockRebuildName(rebuild)) return rebuild;
  }
  return InvalidArgument(
      "a block's rebuild is '{}'; use \"\" (save everything), norms_gelu or norms_gelu_attention",
      name);
}

namespace {

// The block's saved slots in order, each kept or rebuilt under `rebuild`; `rebuilt` picks which.
FlatLayout BlockSlots(int64_t batch, int64_t seq_len, int64_t channels, int64_t heads,
                      BlockRebuild rebuild, bool rebuilt) {
  const int64_t b = batch, t = seq_len, c = channels;
  const bool norms = rebuild != BlockRebuild::kNothing;
  const bool attention = rebuild == BlockRebuild::kNormsGeluAttention;
  FlatLayout layout;
  const auto add = [&](const char* name, Shape shape, bool recomputed) {
    if (recomputed == rebuilt) layout.Add(name, std::move(shape));
  };
  add("ln1", {b, t, c}, norms);
  add("ln1_mean", {b * t}, norms);
  add("ln1_rstd", {b * t}, norms);
  add("qkv", {b, t, 3 * c}, false);
  add("atty", {b, t, c}, attention);
  add("lse", {b, heads, t}, attention);
  add("x_mid", {b, t, c}, attention);
  add("ln2", {b, t, c}, norms);
  add("ln2_mean", {b * t}, norms);
  add("ln2_rstd", {b * t}, norms);
  add("fch", {b, t, 4 * c}, false);
  add("fch_gelu", {b, t, 4 * c}, norms);
  return layout;
}

}  // namespace

FlatLayout TransformerBlockSavedLayout(int64_t batch, int64_t seq_len, int64_t channels,
                                       int64_t heads, BlockRebuild rebuild) {
  return BlockSlots(batch, seq_len, channels, heads, rebuild, /*rebuilt=*/false);
}

FlatLayout TransformerBlockRebuiltLayout(int64_t batch, int64_t seq_len, int64_t channels,
                                         int64_t heads, BlockRebuild rebuild) {
  return BlockSlots(batch, seq_len, channels, heads, rebuild, /*rebuilt=*/true);
}

FlatLayout TransformerBlockStashLayout(int64_t batch, int64_t seq_len, int64_t channels) {
  const int64_t b = batch, t = seq_len, c = channels;
  FlatLayout layout;
  layout.Add("dfcproj", {b, t, c});
  layout.Add("dfc", {b, t, 4 * c});
  layout.Add("dproj", {b, t, c});
  layout.Add("dqkv", {b, t, 3 * c});
  for (const char* name : {"ln2_w", "ln2_b", "ln1_w", "ln1_b"}) layout.Add(name, {c});
  return layout;
}

int64_t TransformerBlockForwardWorkspace(const TransformerDims& dims) {
  return TransformerBlockRebuiltLayout(dims.batch, dims.seq_len, dims.channels, dims.heads,
                                       dims.rebuild)
      .numel();
}

int64_t TransformerBlockInputWorkspace(const TransformerDims& dims) {
  return dims.rows() * dims.channels;
}

int64_t TransformerBlockBackwardWorkspace(const TransformerDims& dims) {
  return TransformerBlockStashLayout(dims.batch, dims.seq_len, dims.channels).numel() +
         TransformerBlockInputWorkspace(dims) + TransformerBlockForwardWorkspace(dims);
}

int64_t TiedLmHeadWorkspace(const TransformerDims& dims) {
  return dims.rows() * (dims.channels + 2);
}

FlatLayout TiedLmHeadSavedLayout(int64_t batch, int64_t seq_len, int64_t channels, int64_t vocab) {
  const int64_t b = batch, t = seq_len;
  FlatLayout layout;
  layout.Add("lnf", {b, t, channels});
  layout.Add("lnf_mean", {b * t});
  layout.Add("lnf_rstd", {b * t});
  layout.Add("dlogits", {b * t, vocab});
  return layout;
}

namespace {

// Builds a bf16 layout: fp32 slots take two elements per value, every slot aligned.
class Bf16LayoutBuilder {
 public:
  void Bf16(std::string name, Shape shape) { Add(std::move(name), std::move(shape)); }
  void F32(std::string name, int64_t count) { Add(std::move(name), Shape{2 * count}); }
  FlatLayout Finish() { return std::move(layout_); }

 private:
  void Add(std::string name, Shape shape) {
    const int64_t misaligned = layout_.numel() % kGpuSlotAlignment;
    if (misaligned != 0) {
      layout_.Add("pad." + name, Shape{kGpuSlotAlignment - misaligned});
    }
    layout_.Add(std::move(name), std::move(shape));
  }
  FlatLayout layout_;
};

}  // namespace

FlatLayout TransformerBlockSavedLayoutBf16(int64_t batch, int64_t seq_len, int64_t channels,
                                           int64_t heads) {
  const int64_t b = batch, t = seq_len, c = channels;
  Bf16LayoutBuilder layout;
  layout.Bf16("ln1", {b, t, c});
  layout.F32("ln1_mean", b * t);
  layout.F32("ln1_rstd", b * t);
  layout.Bf16("qkv", {b, t, 3 * c});
  layout.Bf16("atty", {b, t, c});
  layout.F32("lse", b * heads * t);
  layout.Bf16("x_mid", {b, t, c});
  layout.Bf16("ln2", {b, t, c});
  layout.F32("ln2_mean", b * t);
  layout.F32("ln2_rstd", b * t);
  layout.Bf16("fch", {b, t, 4 * c});
  layout.Bf16("fch_gelu", {b, t, 4 * c});
  return layout.Finish();
}

FlatLayout TiedLmHeadSavedLayoutBf16(int64_t batch, int64_t seq_len, int64_t channels,
                                     int64_t vocab) {
  const int64_t b = batch, t = seq_len;
  Bf16LayoutBuilder layout;
  layout.Bf16("lnf", {b, t, channels});
  layout.F32("lnf_mean", b * t);
  layout.F32("lnf_rstd", b * t);
  layout.F32("losses", b * t);
  layout.Bf16("dlogits", {b * t, TiedLmHeadPaddedVocab(vocab)});
  return layout.Finish();
}

}  // namespace tessera
