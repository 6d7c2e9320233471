#include "ops/cpu/transformer_layers.h"

#include <cstring>
#include <string_view>

#include "ops/cpu/kernels.h"
#include "ops/flat_layout.h"

namespace tessera::cpu {

Status TokenPositionEmbeddingForward(float* x, const int32_t* tokens, const float* emb_params,
                                     const TransformerDims& dims) {
  const FlatLayout layout =
      TokenPositionEmbeddingParamLayout(dims.vocab, dims.max_seq_len, dims.channels);
  FlatView<const float> p(emb_params, layout);
  return EmbeddingForward(x, tokens, p["wte"], p["wpe"], dims.batch, dims.seq_len, dims.channels,
                          dims.vocab);
}

void TokenPositionEmbeddingBackward(float* demb, const float* dx, const int32_t* tokens,
                                    const TransformerDims& dims) {
  const FlatLayout layout =
      TokenPositionEmbeddingParamLayout(dims.vocab, dims.max_seq_len, dims.channels);
  FlatView<float> g(demb, layout);
  EmbeddingBackward(g["wte"], g["wpe"], dx, tokens, dims.batch, dims.seq_len, dims.channels);
}

namespace {

// The block's saved slots for one call: each where it lives, in the saved buffer (kept) or in
// scratch space (what dims.rebuild recomputes; TransformerBlockRebuiltLayout).
template <typename T>
class BlockSaved {
 public:
  BlockSaved(const TransformerDims& dims, T* saved, float* scratch)
      : kept_(TransformerBlockSavedLayout(dims.batch, dims.seq_len, dims.channels, dims.heads,
                                          dims.rebuild)),
        rebuilt_(TransformerBlockRebuiltLayout(dims.batch, dims.seq_len, dims.channels, dims.heads,
                                               dims.rebuild)),
        saved_(saved),
        scratch_(scratch) {}
  T* operator[](std::string_view name) const {
    Result<const FlatSlot*> kept = kept_.Find(name);
    if (kept.ok()) return saved_ + (*kept)->offset;
    return scratch_ + rebuilt_.offset(name);
  }
  // A slot the backward rebuilds. REQUIRES: dims.rebuild recomputes it.
  float* Rebuilt(std::string_view name) const { return scratch_ + rebuilt_.offset(name); }

 private:
  FlatLayout kept_, rebuilt_;
  T* saved_;
  float* scratch_;
};

FlatLayout BlockStash(const TransformerDims& dims) {
  return TransformerBlockStashLayout(dims.batch, dims.seq_len, dims.channels);
}

// Recomputes what dims.rebuild leaves out of the saved buffer, in the forward's order and with
// its kernels (so bit for bit what the forward computed), all but fch_gelu: the backward's GELU
// pass rebuilds that (GeluBackwardRebuilding, one tanh per element for both).
void RebuildSaved(const BlockSaved<const float>& s, const float* x, const float* params,
                  const TransformerDims& dims, int64_t split_min_flops) {
  if (dims.rebuild == BlockRebuild::kNothing) return;
  const int64_t n = dims.rows(), c = dims.channels;
  const FlatLayout param_layout = TransformerBlockParamLayout(c);
  FlatView<const float> p(params, param_layout);
  LayerNormForward(s.Rebuilt("ln1"), s.Rebuilt("ln1_mean"), s.Rebuilt("ln1_rstd"), x, p["ln1_w"],
                   p["ln1_b"], n, c);
  if (dims.rebuild == BlockRebuild::kNormsGeluAttention) {
    AttentionForward(s.Rebuilt("atty"), s.Rebuilt("lse"), s["qkv"], dims.batch, dims.seq_len, c,
                     dims.heads);
    LinearForward(s.Rebuilt("x_mid"), s["atty"], p["proj_w"], p["proj_b"], /*residual=*/x, n, c, c,
                  split_min_flops);
  }
  LayerNormForward(s.Rebuilt("ln2"), s.Rebuilt("ln2_mean"), s.Rebuilt("ln2_rstd"), s["x_mid"],
                   p["ln2_w"], p["ln2_b"], n, c);
}

// `rebuilt_gelu`: where the backward's GELU pass writes the forward's fch_gelu (a block that
// rebuilds it), or null (saved).
void BackwardInput(float* d, float* stash, float* workspace, const float* x,
                   const BlockSaved<const float>& s, const float* params,
                   const TransformerDims& dims, int64_t split_min_flops,
                   float* rebuilt_gelu = nullptr) {
  const int64_t n = dims.rows(), c = dims.channels;
  const FlatLayout param_layout = TransformerBlockParamLayout(c);
  const FlatLayout stash_layout = BlockStash(dims);
  FlatView<const float> p(params, param_layout);
  FlatView<float> st(stash, stash_layout);
  // The gradient entering a layernorm [N,C] (reused for the attention output's).
  float* ln_grad = workspace;
  const auto keep = [n, c](float* to, const float* from) {
    std::memcpy(to, from, static_cast<size_t>(n * c) * sizeof(float));
  };

  // MLP branch: y = x_mid + fcproj(gelu(fc(ln2(x_mid)))). d = dL/dy = dL/dx_mid so far.
  keep(st["dfcproj"], d);
  float* dfc = st["dfc"];
  // The input gradient alone: fch_gelu is not read (the weight half reads it).
  LinearBackward(dfc, nullptr, nullptr, d, nullptr, p["fcproj_w"], n, 4 * c, c,
                 /*accumulate_dx=*/false, split_min_flops);
  if (rebuilt_gelu != nullptr) {
    GeluBackwardRebuilding(dfc, rebuilt_gelu, dfc, s["fch"], n * 4 * c);
  } else {
    GeluBackward(dfc, dfc, s["fch"], n * 4 * c);
  }
  LinearBackward(ln_grad, nullptr, nullptr, dfc, s["ln2"], p["fc_w"], n, c, 4 * c, false,
                 split_min_flops);
  LayerNormBackward(d, st["ln2_w"], st["ln2_b"], ln_grad, s["x_mid"], p["ln2_w"], s["ln2_mean"],
                    s["ln2_rstd"], n, c, /*accumulate_dx=*/true);

  // Attention branch: x_mid = x + proj(attention(qkv(ln1(x)))). d = dL/dx_mid now.
  keep(st["dproj"], d);
  float* datty = ln_grad;
  LinearBackward(datty, nullptr, nullptr, d, s["atty"], p["proj_w"], n, c, c, false,
                 split_min_flops);
  AttentionBackward(st["dqkv"], datty, s["qkv"], s["lse"], dims.batch, dims.seq_len, c, dims.heads);
  float* dln1 = ln_grad;
  LinearBackward(dln1, nullptr, nullptr, st["dqkv"], s["ln1"], p["qkv_w"], n, c, 3 * c, false,
                 split_min_flops);
  LayerNormBackward(d, st["ln1_w"], st["ln1_b"], dln1, x, p["ln1_w"], s["ln1_mean"], s["ln1_rstd"],
                    n, c, /*accumulate_dx=*/true);
}

void BackwardWeight(float* dparams, const float* stash, const BlockSaved<const float>& s,
                    const TransformerDims& dims, int64_t split_min_flops) {
  const int64_t n = dims.rows(), c = dims.channels;
  const FlatLayout param_layout = TransformerBlockParamLayout(c);
  const FlatLayout stash_layout = BlockStash(dims);
  FlatView<const float> st(stash, stash_layout);
  FlatView<float> g(dparams, param_layout);
  // dW = dout^T x and db = sum(dout) per linear, from the gradient that entered it.
  LinearBackward(nullptr, g["fcproj_w"], g["fcproj_b"], st["dfcproj"], s["fch_gelu"], nullptr, n,
                 4 * c, c, false, split_min_flops);
  LinearBackward(nullptr, g["fc_w"], g["fc_b"], st["dfc"], s["ln2"], nullptr, n, c, 4 * c, false,
                 split_min_flops);
  LinearBackward(nullptr, g["proj_w"], g["proj_b"], st["dproj"], s["atty"], nullptr, n, c, c, false,
                 split_min_flops);
  LinearBackward(nullptr, g["qkv_w"], g["qkv_b"], st["dqkv"], s["ln1"], nullptr, n, c, 3 * c, false,
                 split_min_flops);
  for (const char* name : {"ln2_w", "ln2_b", "ln1_w", "ln1_b"}) {
    std::memcpy(g[name], st[name], static_cast<size_t>(c) * sizeof(float));
  }
}

}  // namespace

void TransformerBlockForward(float* y, float* saved, float* workspace, const float* x,
                             const float* params, const TransformerDims& dims,
                             int64_t split_min_flops) {
  const int64_t n = dims.rows(), c = dims.channels;
  const FlatLayout param_layout = TransformerBlockParamLayout(c);
  FlatView<const float> p(params, param_layout);
  const BlockSaved<float> s(dims, saved, workspace);

  LayerNormForward(s["ln1"], s["ln1_mean"], s["ln1_rstd"], x, p["ln1_w"], p["ln1_b"], n, c);
  LinearForward(s["qkv"], s["ln1"], p["qkv_w"], p["qkv_b"], nullptr, n, c, 3 * c, split_min_flops);
  AttentionForward(s["atty"], s["lse"], s["qkv"], dims.batch, dims.seq_len, c, dims.heads);
  LinearForward(s["x_mid"], s["atty"], p["proj_w"], p["proj_b"], /*residual=*/x, n, c, c,
                split_min_flops);
  LayerNormForward(s["ln2"], s["ln2_mean"], s["ln2_rstd"], s["x_mid"], p["ln2_w"], p["ln2_b"], n,
                   c);
  LinearForward(s["fch"], s["ln2"], p["fc_w"], p["fc_b"], nullptr, n, c, 4 * c, split_min_flops);
  GeluForward(s["fch_gelu"], s["fch"], n * 4 * c);
  LinearForward(y, s["fch_gelu"], p["fcproj_w"], p["fcproj_b"], /*residual=*/s["x_mid"], n, 4 * c,
                c, split_min_flops);
}

void TransformerBlockBackward(float* d, float* dparams, float* workspace, const float* x,
                              const float* saved, const float* params, const TransformerDims& dims,
                              int64_t split_min_flops) {
  float* stash = workspace;
  float* input_workspace = stash + BlockStash(dims).numel();
  const BlockSaved<const float> s(dims, saved,
                                  input_workspace + TransformerBlockInputWorkspace(dims));
  RebuildSaved(s, x, params, dims, split_min_flops);
  BackwardInput(d, stash, input_workspace, x, s, params, dims, split_min_flops,
                dims.rebuild == BlockRebuild::kNothing ? nullptr : s.Rebuilt("fch_gelu"));
  BackwardWeight(dparams, stash, s, dims, split_min_flops);
}

void TransformerBlockBackwardInput(float* d, float* stash, float* workspace, const float* x,
                                   const float* saved, const float* params,
                                   const TransformerDims& dims, int64_t split_min_flops) {
  TESSERA_CHECK(dims.rebuild == BlockRebuild::kNothing, "the split backward rebuilds nothing");
  BackwardInput(d, stash, workspace, x, BlockSaved<const float>(dims, saved, nullptr), params, dims,
                split_min_flops);
}

void TransformerBlockBackwardWeight(float* dparams, const float* stash, const float* saved,
                                    const TransformerDims& dims, int64_t split_min_flops) {
  TESSERA_CHECK(dims.rebuild == BlockRebuild::kNothing, "the split backward rebuilds nothing");
  BackwardWeight(dparams, stash, BlockSaved<const float>(dims, saved, nullptr), dims,
                 split_min_flops);
}

Result<float> TiedLmHeadForward(float* saved, const float* x, const float* head_params,
                                const float* wte, const int32_t* targets,
                                const TransformerDims& dims, float grad_scale,
                                int64_t split_min_flops) {
  const int64_t n = dims.rows(), c = dims.channels;
  const FlatLayout head_layout = TiedLmHeadParamLayout(c);
  const FlatLayout saved_layout = TiedLmHeadSavedLayout(dims.batch, dims.seq_len, c, dims.vocab);
  FlatView<const float> p(head_params, head_layout);
  FlatView<float> s(saved, saved_layout);
  LayerNormForward(s["lnf"], s["lnf_mean"], s["lnf_rstd"], x, p["lnf_w"], p["lnf_b"], n, c);
  float* logits = s["dlogits"];
  LinearForward(logits, s["lnf"], wte, nullptr, nullptr, n, c, dims.vocab, split_min_flops);
  return SoftmaxCrossEntropy(logits, logits, targets, n, dims.vocab, grad_scale);
}

void TiedLmHeadBackward(float* dx, float* dhead, float* demb, float* workspace, const float* x,
                        const float* saved, const float* head_params, const float* wte,
                        const TransformerDims& dims, int64_t split_min_flops) {
  const int64_t n = dims.rows(), c = dims.channels;
  const FlatLayout head_layout = TiedLmHeadParamLayout(c);
  const FlatLayout saved_layout = TiedLmHeadSavedLayout(dims.batch, dims.seq_len, c, dims.vocab);
  const FlatLayout emb_layout = TokenPositionEmbeddingParamLayout(dims.vocab, dims.max_seq_len, c);
  FlatView<const float> p(head_params, head_layout);
  FlatView<const float> s(saved, saved_layout);
  FlatView<float> g(dhead, head_layout);
  FlatView<float> ge(demb, emb_layout);

  float* dlnf = workspace;
  // logits = lnf @ wte^T: dlnf = dlogits @ wte, dwte = dlogits^T @ lnf.
  LinearBackward(dlnf, ge["wte"], nullptr, s["dlogits"], s["lnf"], wte, n, c, dims.vocab, false,
                 split_min_flops);
  std::memset(ge["wpe"], 0, static_cast<size_t>(dims.max_seq_len * c) * sizeof(float));
  LayerNormBackward(dx, g["lnf_w"], g["lnf_b"], dlnf, x, p["lnf_w"], s["lnf_mean"], s["lnf_rstd"],
                    n, c, /*accumulate_dx=*/false);
}

void TiedLmHeadLogits(float* logits, float* workspace, const float* x, const float* head_params,
                      const float* wte, const TransformerDims& dims, int64_t split_min_flops) {
  const int64_t n = dims.rows(), c = dims.channels;
  const FlatLayout head_layout = TiedLmHeadParamLayout(c);
  FlatView<const float> p(head_params, head_layout);
  float* lnf = workspace;
  float* mean = lnf + n * c;
  float* rstd = mean + n;
  LayerNormForward(lnf, mean, rstd, x, p["lnf_w"], p["lnf_b"], n, c);
  LinearForward(logits, lnf, wte, nullptr, nullptr, n, c, dims.vocab, split_min_flops);
}

}  // namespace tessera::cpu
