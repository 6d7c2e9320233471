// Every op's backward checked against finite differences of its forward
// (tests/op_gradient_check.h), and the ops that have no gradient against what they promise.
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <utility>

#include <gmock/gmock.h>

#include "core/checksum.h"
#include "core/collective_task.h"
#include "op_gradient_check.h"
#include "ops/standard_ops.h"
#include "ops/volume_ops.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using Tensors = std::vector<Tensor>;

// The backward's gradients on 32 elements of each checked input.
void CheckGradients(GradientCase c) { ExpectGradientsMatchFiniteDifferences(std::move(c), 32); }

TEST(OpGradientTest, Embedding) {
  CheckGradients({
      .forward = "embedding_forward",
      .backward = "embedding_backward",
      .backward_attrs = {{"vocab", int64_t{11}}, {"max_seq_len", int64_t{7}}},
      .inputs = {RandomTokens({2, 5}, 11, 1), RandomTensor({11, 8}, 2), RandomTensor({7, 8}, 3)},
      .differentiable_outputs = {0},
      .checked = {{1, 0}, {2, 1}},
      .backward_inputs = [](const Tensors& in, const Tensors&, const Tensors& g) -> Tensors {
        return {g[0], in[0]};
      },
  });
}

TEST(OpGradientTest, LayerNorm) {
  CheckGradients({
      .forward = "layernorm_forward",
      .backward = "layernorm_backward",
      .inputs = {RandomTensor({6, 16}, 1, 2.0f), RandomTensor({16}, 2), RandomTensor({16}, 3)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}, {1, 1}, {2, 2}},
      .backward_inputs = [](const Tensors& in, const Tensors& out, const Tensors& g) -> Tensors {
        return {g[0], in[0], in[1], out[1], out[2]};
      },
  });
}

TEST(OpGradientTest, Linear) {
  CheckGradients({
      .forward = "linear_forward",
      .backward = "linear_backward",
      .inputs = {RandomTensor({2, 3, 8}, 1), RandomTensor({12, 8}, 2), RandomTensor({12}, 3)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}, {1, 1}, {2, 2}},
      .backward_inputs = [](const Tensors& in, const Tensors&, const Tensors& g) -> Tensors {
        return {g[0], in[0], in[1]};
      },
  });
}

TEST(OpGradientTest, LinearNoBias) {
  CheckGradients({
      .forward = "linear_no_bias_forward",
      .backward = "linear_no_bias_backward",
      .inputs = {RandomTensor({2, 3, 8}, 1), RandomTensor({12, 8}, 2)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}, {1, 1}},
      .backward_inputs = [](const Tensors& in, const Tensors&, const Tensors& g) -> Tensors {
        return {g[0], in[0], in[1]};
      },
  });
}

TEST(OpGradientTest, Matmul) {
  CheckGradients({
      .forward = "matmul_forward",
      .backward = "matmul_backward",
      .inputs = {RandomTensor({5, 7}, 1), RandomTensor({7, 6}, 2)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}, {1, 1}},
      .backward_inputs = [](const Tensors& in, const Tensors&, const Tensors& g) -> Tensors {
        return {g[0], in[0], in[1]};
      },
  });
}

// Ring attention's parts through their rules, both outputs differentiated: a block of keys
// before the queries (all visible), on the diagonal (causal), and partly after them; the merge.
TEST(OpGradientTest, AttentionBlocksAndTheirMerge) {
  for (int64_t offset : {-5, 0, 2}) {
    SCOPED_TRACE(offset);
    CheckGradients({.forward = "attention_block_forward",
                    .forward_attrs = {{"heads", int64_t{2}}, {"key_offset", offset}},
                    .inputs = {RandomTensor({2, 6, 8}, 1, 1.5f), RandomTensor({2, 5, 16}, 2, 1.5f)},
                    .differentiable_outputs = {0, 1}});
  }
  CheckGradients({.forward = "attention_merge_forward",
                  .forward_attrs = {{"heads", int64_t{2}}},
                  .inputs = {RandomTensor({2, 3, 8}, 1), RandomTensor({2, 2, 3}, 2),
                             RandomTensor({2, 3, 8}, 3), RandomTensor({2, 2, 3}, 4)},
                  .differentiable_outputs = {0, 1}});
}

// A ring step in one op: the block's attention merged into the steps before equals the two ops
// apart, and its gradients (all four inputs, both outputs) match finite differences, the block
// before, on and after the diagonal, and merged into a part that saw no key.
TEST(OpGradientTest, AttentionBlockAccumulateIsTheBlockMerged) {
  const Attrs heads{{"heads", int64_t{2}}};
  const Tensor q = RandomTensor({2, 6, 8}, 1, 1.5f), kv = RandomTensor({2, 6, 16}, 2, 1.5f);
  const Tensor out_prev = RandomTensor({2, 6, 8}, 3), lse_prev = RandomTensor({2, 2, 6}, 4);
  for (int64_t offset : {-6, 0, 3}) {
    SCOPED_TRACE(offset);
    Attrs block = heads;
    block.Set("key_offset", offset);
    ASSERT_OK_AND_ASSIGN(Tensors part, RunKernel("attention_block_forward", {q, kv}, block));
    ASSERT_OK_AND_ASSIGN(Tensors apart, RunKernel("attention_merge_forward",
                                                  {out_prev, lse_prev, part[0], part[1]}, heads));
    ASSERT_OK_AND_ASSIGN(Tensors fused, RunKernel("attention_block_accumulate_forward",
                                                  {q, kv, out_prev, lse_prev}, block));
    for (int o = 0; o < 2; ++o) {
      const std::vector<float> expected = ToVector(apart[o]), got = ToVector(fused[o]);
      for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], expected[i], 1e-6f) << o;
    }
    CheckGradients({.forward = "attention_block_accumulate_forward",
                    .forward_attrs = block,
                    .inputs = {q, kv, out_prev, lse_prev},
                    .differentiable_outputs = {0, 1}});
  }
  // The first step's partial (the diagonal) merged into nothing seen: lse_prev -inf (2 x 2 x 6).
  const std::vector<float> none(24, -std::numeric_limits<float>::infinity());
  ASSERT_OK_AND_ASSIGN(Tensors first,
                       RunKernel("attention_block_accumulate_forward",
                                 {q, kv, FloatTensor({2, 6, 8}, std::vector<float>(96, 0.0f)),
                                  FloatTensor({2, 2, 6}, none)},
                                 heads));
  ASSERT_OK_AND_ASSIGN(Tensors alone, RunKernel("attention_block_forward", {q, kv}, heads));
  const std::vector<float> expected = ToVector(alone[0]), got = ToVector(first[0]);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], expected[i], 1e-6f) << i;
}

// The fused QKV parted into Q and the K/V block (ring attention): the columns as they are, and
// the gradients joined back through the rule.
TEST(OpGradientTest, SplitLastPartsTheLastDimension) {
  const Tensor x = FloatTensor(Shape{2, 3}, {1, 2, 3, 4, 5, 6});
  ASSERT_OK_AND_ASSIGN(Tensors parts,
                       RunKernel("split_last_forward", {x}, Attrs{{"first", int64_t{1}}}));
  EXPECT_EQ(parts[0].shape(), (Shape{2, 1}));
  EXPECT_EQ(ToVector(parts[0]), (std::vector<float>{1, 4}));
  EXPECT_EQ(ToVector(parts[1]), (std::vector<float>{2, 3, 5, 6}));
  CheckGradients({.forward = "split_last_forward",
                  .forward_attrs = {{"first", int64_t{8}}},
                  .inputs = {RandomTensor({2, 5, 24}, 1)},
                  .differentiable_outputs = {0, 1}});
  for (int64_t first : {0, 3}) {
    EXPECT_FALSE(CpuRegistry()
                     .InferShapes("split_last_forward",
                                  {TensorMeta{Shape{2, 3}, DType::kF32, Device::Cpu()}},
                                  {{"first", first}})
                     .ok())
        << first;
  }
}

// A ring step's keys are the block k rotations brought: at rank 2 of 4, step 0 its own (on the
// diagonal), step 1 rank 1's, 2 rank 0's (before the queries), 3 rank 3's (after them, unseen).
TEST(OpGradientTest, RingStepsPlaceTheirBlockOfKeys) {
  for (const auto& [step, offset] :
       std::vector<std::pair<int64_t, int64_t>>{{0, 0}, {1, -5}, {2, -10}, {3, 5}}) {
    const Attrs attrs{
        {kRingStepAttr, step}, {"ranks", int64_t{4}}, {kSequenceRankAttr, int64_t{2}}};
    EXPECT_EQ(AttentionBlockKeyOffset(attrs, 5), offset) << "step " << step;
  }
  EXPECT_EQ(AttentionBlockKeyOffset(Attrs{{"key_offset", int64_t{-3}}}, 5), -3);
  const std::vector<TensorMeta> shapes{TensorMeta{Shape{1, 4, 8}, DType::kF32, Device::Cpu()},
                                       TensorMeta{Shape{1, 4, 16}, DType::kF32, Device::Cpu()}};
  EXPECT_TRUE(
      CpuRegistry()
          .InferShapes("attention_block_forward", shapes,
                       {{"heads", int64_t{2}}, {kRingStepAttr, int64_t{3}}, {"ranks", int64_t{4}}})
          .ok());
  Result<std::vector<TensorMeta>> past = CpuRegistry().InferShapes(
      "attention_block_forward", shapes,
      {{"heads", int64_t{2}}, {kRingStepAttr, int64_t{4}}, {"ranks", int64_t{4}}});
  ASSERT_FALSE(past.ok());
  EXPECT_NE(past.status().message().find("ring_step 4 of ranks 4"), std::string::npos)
      << past.status().ToString();
  // The same kernel as the explicit offset's: step 1 at rank 2 of 4 is key_offset -4 here.
  const Tensor q = RandomTensor({1, 4, 8}, 3), kv = RandomTensor({1, 4, 16}, 4);
  ASSERT_OK_AND_ASSIGN(Tensors ring, RunKernel("attention_block_forward", {q, kv},
                                               {{"heads", int64_t{2}},
                                                {kRingStepAttr, int64_t{1}},
                                                {"ranks", int64_t{4}},
                                                {kSequenceRankAttr, int64_t{2}}}));
  ASSERT_OK_AND_ASSIGN(Tensors explicit_offset,
                       RunKernel("attention_block_forward", {q, kv},
                                 {{"heads", int64_t{2}}, {"key_offset", int64_t{-4}}}));
  EXPECT_EQ(ToVector(ring[0]), ToVector(explicit_offset[0]));
  EXPECT_EQ(ToVector(ring[1]), ToVector(explicit_offset[1]));
}

// The blocks of a whole sequence's keys, merged in any order, are attention_forward: its output
// and log-sum-exp (the parts' gradients are checked against finite differences above).
TEST(OpGradientTest, MergedAttentionBlocksAreCausalAttention) {
  constexpr int64_t kB = 2, kS = 8, kC = 8, kBlocks = 4, kBlock = kS / kBlocks;
  const Attrs heads{{"heads", int64_t{2}}};
  const Tensor qkv = RandomTensor({kB, kS, 3 * kC}, 1, 1.5f);
  const std::vector<float> values = ToVector(qkv);
  ASSERT_OK_AND_ASSIGN(Tensors whole, RunKernel("attention_forward", {qkv}, heads));
  // q [B, S, C], and block n's keys and values [B, S/4, 2C].
  std::vector<float> q;
  std::vector<std::vector<float>> kv(kBlocks);
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t i = 0; i < kS; ++i) {
      const float* row = values.data() + (b * kS + i) * 3 * kC;
      q.insert(q.end(), row, row + kC);
      kv[static_cast<size_t>(i / kBlock)].insert(kv[static_cast<size_t>(i / kBlock)].end(),
                                                 row + kC, row + 3 * kC);
    }
  }
  const Tensor q_tensor = FloatTensor(Shape{kB, kS, kC}, q);
  Tensors merged;
  for (int64_t n : {2, 0, 3, 1}) {  // any order
    Attrs block = heads;
    block.Set("key_offset", n * kBlock);
    ASSERT_OK_AND_ASSIGN(
        Tensors part,
        RunKernel("attention_block_forward",
                  {q_tensor, FloatTensor(Shape{kB, kBlock, 2 * kC}, kv[static_cast<size_t>(n)])},
                  block));
    if (merged.empty()) {
      merged = part;
      continue;
    }
    ASSERT_OK_AND_ASSIGN(merged, RunKernel("attention_merge_forward",
                                           {merged[0], merged[1], part[0], part[1]}, heads));
  }
  const std::vector<float> expected = ToVector(whole[0]), got = ToVector(merged[0]);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], expected[i], 1e-5f) << i;
  const std::vector<float> expected_lse = ToVector(whole[1]), got_lse = ToVector(merged[1]);
  ASSERT_EQ(got_lse.size(), expected_lse.size());
  for (size_t i = 0; i < got_lse.size(); ++i) EXPECT_NEAR(got_lse[i], expected_lse[i], 1e-5f) << i;
  // A block wholly after the queries: no key visible, out 0 and lse -inf; merged, it changes
  // nothing.
  Attrs after = heads;
  after.Set("key_offset", kS);
  ASSERT_OK_AND_ASSIGN(Tensors unseen,
                       RunKernel("attention_block_forward",
                                 {q_tensor, FloatTensor(Shape{kB, kBlock, 2 * kC}, kv[0])}, after));
  for (float v : ToVector(unseen[0])) EXPECT_EQ(v, 0.0f);
  for (float v : ToVector(unseen[1])) EXPECT_TRUE(std::isinf(v) && v < 0);
  ASSERT_OK_AND_ASSIGN(
      Tensors same,
      RunKernel("attention_merge_forward", {merged[0], merged[1], unseen[0], unseen[1]}, heads));
  EXPECT_EQ(ToVector(same[0]), ToVector(merged[0]));
  EXPECT_EQ(ToVector(same[1]), ToVector(merged[1]));
}

TEST(OpGradientTest, CausalAttention) {
  const Attrs heads{{"heads", int64_t{2}}};
  CheckGradients({
      .forward = "attention_forward",
      .backward = "attention_backward",
      .forward_attrs = heads,
      .backward_attrs = heads,
      .inputs = {RandomTensor({2, 6, int64_t{3} * 8}, 1, 1.5f)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}},
      .backward_inputs = [](const Tensors& in, const Tensors& out, const Tensors& g) -> Tensors {
        return {g[0], in[0], out[1]};
      },
  });
}

TEST(OpGradientTest, Gelu) {
  CheckGradients({
      .forward = "gelu_forward",
      .backward = "gelu_backward",
      .inputs = {RandomTensor({40}, 1, 3.0f)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}},
      .backward_inputs = [](const Tensors& in, const Tensors&, const Tensors& g) -> Tensors {
        return {g[0], in[0]};
      },
      .step = 1e-3f,
  });
}

TEST(OpGradientTest, ResidualAdd) {
  CheckGradients({
      .forward = "add_forward",
      .backward = "add_backward",
      .inputs = {RandomTensor({10}, 1), RandomTensor({10}, 2)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}, {1, 1}},
      .backward_inputs = [](const Tensors&, const Tensors&, const Tensors& g) -> Tensors {
        return {g[0]};
      },
  });
}

TEST(OpGradientTest, BiasAdd) {
  CheckGradients({
      .forward = "bias_add_forward",
      .backward = "bias_add_backward",
      .inputs = {RandomTensor({3, 4, 5}, 1), RandomTensor({5}, 2)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}, {1, 1}},
      .backward_inputs = [](const Tensors&, const Tensors&, const Tensors& g) -> Tensors {
        return {g[0]};
      },
  });
  // A bias that is not the last dimension's size is refused, naming both shapes.
  Result<std::vector<Tensor>> refused =
      RunKernel("bias_add_forward", {RandomTensor({3, 4}, 1), RandomTensor({3}, 2)});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("[3]"), std::string::npos)
      << refused.status().ToString();
}

// The vocabulary-parallel ops at tensor rank 1 of 3 (rows [11, 22) of a 33-token vocabulary),
// checked through their gradient rules.
const Attrs kRank1Of3{{"ranks", int64_t{3}}, {kTensorRankAttr, int64_t{1}}};

TEST(OpGradientTest, VocabShardEmbedding) {
  CheckGradients({
      .forward = "vocab_shard_embedding_forward",
      .forward_attrs = kRank1Of3,
      .inputs = {RandomTokens({3, 7}, 33, 1), RandomTensor({11, 8}, 2)},
  });
}

TEST(OpGradientTest, PositionAdd) {
  CheckGradients({
      .forward = "position_add_forward",
      .inputs = {RandomTensor({2, 5, 8}, 1), RandomTensor({7, 8}, 2)},
  });
  Result<std::vector<Tensor>> short_wpe =
      RunKernel("position_add_forward", {RandomTensor({2, 5, 8}, 1), RandomTensor({4, 8}, 2)});
  ASSERT_FALSE(short_wpe.ok());
  EXPECT_NE(short_wpe.status().message().find("[>= 5, 8]"), std::string::npos)
      << short_wpe.status().ToString();
}

TEST(OpGradientTest, VocabShardLogitStats) {
  CheckGradients({
      .forward = "vocab_shard_logit_stats",
      .forward_attrs = kRank1Of3,
      .inputs = {RandomTensor({12, 11}, 1, 3.0f), RandomTokens({12}, 33, 2)},
  });
  Result<std::vector<Tensor>> bad_rank =
      RunKernel("vocab_shard_logit_stats", {RandomTensor({4, 11}, 1), RandomTokens({4}, 33, 2)},
                Attrs{{"ranks", int64_t{3}}, {kTensorRankAttr, int64_t{3}}});
  ASSERT_FALSE(bad_rank.ok());
  EXPECT_NE(bad_rank.status().message().find("[0, 3)"), std::string::npos)
      << bad_rank.status().ToString();
}

TEST(OpGradientTest, CrossEntropyFromStats) {
  CheckGradients({
      .forward = "cross_entropy_from_stats",
      .inputs = {RandomTensor({6, 4}, 1, 4.0f)},
  });
}

// The Ulysses layout ops (three heads over two ranks: one padded head), through their rules.
const Attrs kThreeHeadsOverTwo{
    {"heads", int64_t{3}}, {"ranks", int64_t{2}}, {"groups", int64_t{3}}};

TEST(OpGradientTest, HeadsToChunksAndBack) {
  CheckGradients({.forward = "heads_to_chunks",
                  .forward_attrs = kThreeHeadsOverTwo,
                  .inputs = {RandomTensor({2, 3, int64_t{3} * 3 * 4}, 1)}});
  CheckGradients({.forward = "chunks_to_heads",
                  .forward_attrs = kThreeHeadsOverTwo,
                  .inputs = {RandomTensor({2, 2, 3, int64_t{3} * 2 * 4}, 2)}});
  Result<std::vector<Tensor>> uneven =
      RunKernel("heads_to_chunks", {RandomTensor({2, 3, 3 * 3 * 4 + 1}, 1)}, kThreeHeadsOverTwo);
  ASSERT_FALSE(uneven.ok());
  EXPECT_NE(uneven.status().message().find("groups x heads x d = 3 x 3 x d"), std::string::npos)
      << uneven.status().ToString();
}

// The all-to-all's layouts (run by the collective engine; here their shapes): to_sequence joins
// [P, B, S, F] into [B, P S, F], from_sequence splits it back; a bad layout names the choices.
TEST(OpGradientTest, AllToAllLayoutsShapeTheSequence) {
  const Attrs member{
      {kCollectiveAttr, int64_t{1}}, {kRankAttr, int64_t{0}}, {kGroupSizeAttr, int64_t{2}}};
  const TensorMeta blocks{Shape{2, 3, 4, 5}, DType::kF32, Device::Cpu()};
  Attrs to = member;
  to.Set(kLayoutAttr, std::string("to_sequence"));
  ASSERT_OK_AND_ASSIGN(auto joined, CpuRegistry().InferShapes("all_to_all", {blocks}, to));
  EXPECT_EQ(joined[0].shape, (Shape{3, 8, 5}));
  Attrs from = member;
  from.Set(kLayoutAttr, std::string("from_sequence"));
  ASSERT_OK_AND_ASSIGN(auto split, CpuRegistry().InferShapes("all_to_all", {joined[0]}, from));
  EXPECT_EQ(split[0].shape, blocks.shape);
  EXPECT_EQ(AdjointExchange(ExchangeLayout::kToSequence), ExchangeLayout::kFromSequence);
  // A ring rotation, and a halo (spatial parallelism's boundary plane), send the whole buffer to
  // one neighbour, any element count: out is x's shape, and the bytes one member sends are x's,
  // not (n - 1) / n of them; each direction is the other's adjoint.
  const TensorMeta odd{Shape{3, 7}, DType::kF32, Device::Cpu()};
  for (const auto& [next, previous] :
       {std::pair{ExchangeLayout::kRingNext, ExchangeLayout::kRingPrevious},
        std::pair{ExchangeLayout::kHaloNext, ExchangeLayout::kHaloPrevious}}) {
    Attrs whole = member;
    whole.Set(kLayoutAttr, std::string(ExchangeLayoutName(next)));
    ASSERT_OK_AND_ASSIGN(auto passed, CpuRegistry().InferShapes("all_to_all", {odd}, whole));
    EXPECT_EQ(passed[0].shape, odd.shape);
    ASSERT_OK_AND_ASSIGN(OpCost sent, CpuRegistry().Cost("all_to_all", {odd}, whole));
    EXPECT_EQ(sent.bytes, 21.0 * 4);
    EXPECT_EQ(AdjointExchange(next), previous);
    EXPECT_EQ(AdjointExchange(previous), next);
  }
  ASSERT_OK_AND_ASSIGN(OpCost exchange, CpuRegistry().Cost("all_to_all", {blocks}, member));
  EXPECT_EQ(exchange.bytes, 120.0 * 4 / 2);
  Attrs bad = member;
  bad.Set(kLayoutAttr, std::string("diagonal"));
  Result<std::vector<TensorMeta>> refused = CpuRegistry().InferShapes("all_to_all", {blocks}, bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("ring_previous, halo_next or halo_previous"),
            std::string::npos)
      << refused.status().ToString();
}

// heads_linear reads the chunks in place: the linear of chunks_to_heads' regrouped copy, and its
// gradients through its rule (three heads over two ranks, one padded).
TEST(OpGradientTest, HeadsLinearIsTheLinearOfTheRegroupedHeads) {
  const Attrs attrs{{"heads", int64_t{3}}, {"ranks", int64_t{2}}};
  const Tensor chunks = RandomTensor({2, 2, 3, int64_t{2} * 4}, 1);
  const Tensor w = RandomTensor({5, int64_t{3} * 4}, 2), b = RandomTensor({5}, 3);
  CheckGradients(
      {.forward = "heads_linear_forward", .forward_attrs = attrs, .inputs = {chunks, w, b}});
  ASSERT_OK_AND_ASSIGN(auto regrouped, RunKernel("chunks_to_heads", {chunks}, attrs));
  ASSERT_OK_AND_ASSIGN(auto expected, RunKernel("linear_forward", {regrouped[0], w, b}));
  ASSERT_OK_AND_ASSIGN(auto got, RunKernel("heads_linear_forward", {chunks, w, b}, attrs));
  EXPECT_LT(ScaledMaxError(ToVector(got[0]), ToVector(expected[0])), 1e-6);
  Result<std::vector<Tensor>> wide =
      RunKernel("heads_linear_forward", {chunks, RandomTensor({5, 16}, 2), b}, attrs);
  ASSERT_FALSE(wide.ok());
  EXPECT_NE(wide.status().message().find("[5, 16] but must be [O, 12]"), std::string::npos)
      << wide.status().ToString();
}

// Ulysses' exchange, simulated: P = 2 sequence ranks each hold half the positions of QKV
// [B, S, 3 H d] (H = 3: rank 1's second head is padding). heads_to_chunks, then the all-to-all
// (block j of rank i to rank j, placed at i) joined into the sequence order as the collective
// engine does it (MoveSequenceBlocks: layout to_sequence), give rank j the whole sequence of its
// heads; the way back (layout from_sequence) and chunks_to_heads bring each rank back its
// positions of every head.
TEST(OpGradientTest, UlyssesExchangeRegroupsSequenceAndHeads) {
  constexpr int64_t kRanks = 2, kB = 2, kS = 6, kHeads = 3, kD = 4, kLocal = kS / kRanks;
  const Tensor whole = RandomTensor({kB, kS, 3 * kHeads * kD}, 1);
  const std::vector<float> values = ToVector(whole);
  const auto at = [&](int64_t b, int64_t s, int64_t g, int64_t h, int64_t i) {
    return values[static_cast<size_t>((((b * kS + s) * 3 + g) * kHeads + h) * kD + i)];
  };
  std::vector<std::vector<float>> sent(kRanks);  // each rank's [P, B, S/P, 3 Hp d]
  for (int64_t r = 0; r < kRanks; ++r) {
    std::vector<float> local;
    for (int64_t b = 0; b < kB; ++b) {
      for (int64_t s = 0; s < kLocal; ++s) {
        for (int64_t x = 0; x < 3 * kHeads * kD; ++x) {
          local.push_back(
              values[static_cast<size_t>((b * kS + r * kLocal + s) * 3 * kHeads * kD + x)]);
        }
      }
    }
    ASSERT_OK_AND_ASSIGN(auto chunks, RunKernel("heads_to_chunks",
                                                {FloatTensor({kB, kLocal, 3 * kHeads * kD}, local)},
                                                kThreeHeadsOverTwo));
    sent[static_cast<size_t>(r)] = ToVector(chunks[0]);
  }
  const int64_t block = kB * kLocal * 3 * 2 * kD;  // Hp = 2
  std::vector<std::vector<float>> back(kRanks);
  for (int64_t j = 0; j < kRanks; ++j) {
    std::vector<float> received;
    for (int64_t i = 0; i < kRanks; ++i) {
      const auto& from = sent[static_cast<size_t>(i)];
      received.insert(received.end(), from.begin() + j * block, from.begin() + (j + 1) * block);
    }
    std::vector<float> heads(received.size());
    MoveSequenceBlocks(heads.data(), received.data(), kRanks, kB, kLocal, int64_t{3} * 2 * kD * 4,
                       /*to_sequence=*/true);
    ASSERT_EQ(heads.size(), static_cast<size_t>(kB * kS * 3 * 2 * kD));
    for (int64_t b = 0; b < kB; ++b) {
      for (int64_t s = 0; s < kS; ++s) {
        for (int64_t g = 0; g < 3; ++g) {
          for (int64_t k = 0; k < 2; ++k) {
            const int64_t h = j * 2 + k;
            for (int64_t i = 0; i < kD; ++i) {
              const float got =
                  heads[static_cast<size_t>((((b * kS + s) * 3 + g) * 2 + k) * kD + i)];
              EXPECT_EQ(got, h < kHeads ? at(b, s, g, h, i) : 0.0f) << b << s << g << h << i;
            }
          }
        }
      }
    }
    // Back: this rank's heads (its Q part, as an attention output would be) over the sequence.
    std::vector<float> out;
    for (int64_t b = 0; b < kB; ++b) {
      for (int64_t s = 0; s < kS; ++s) {
        for (int64_t x = 0; x < 2 * kD; ++x) {
          out.push_back(heads[static_cast<size_t>((b * kS + s) * 3 * 2 * kD + x)]);
        }
      }
    }
    std::vector<float> split(out.size());
    MoveSequenceBlocks(out.data(), split.data(), kRanks, kB, kLocal, 2 * kD * 4,
                       /*to_sequence=*/false);
    back[static_cast<size_t>(j)] = split;
  }
  const int64_t out_block = kB * kLocal * 2 * kD;
  for (int64_t i = 0; i < kRanks; ++i) {
    std::vector<float> received;
    for (int64_t j = 0; j < kRanks; ++j) {
      const auto& from = back[static_cast<size_t>(j)];
      received.insert(received.end(), from.begin() + i * out_block,
                      from.begin() + (i + 1) * out_block);
    }
    ASSERT_OK_AND_ASSIGN(
        auto regrouped,
        RunKernel("chunks_to_heads", {FloatTensor({kRanks, kB, kLocal, 2 * kD}, received)},
                  Attrs{{"heads", kHeads}, {"ranks", kRanks}}));
    const std::vector<float> mine = ToVector(regrouped[0]);
    ASSERT_EQ(mine.size(), static_cast<size_t>(kB * kLocal * kHeads * kD));
    for (int64_t b = 0; b < kB; ++b) {
      for (int64_t s = 0; s < kLocal; ++s) {
        for (int64_t h = 0; h < kHeads; ++h) {
          for (int64_t x = 0; x < kD; ++x) {
            EXPECT_EQ(mine[static_cast<size_t>(((b * kLocal + s) * kHeads + h) * kD + x)],
                      at(b, i * kLocal + s, 0, h, x));
          }
        }
      }
    }
  }
}

// position_add at sequence rank 1 adds the positions after the first shard's.
TEST(OpGradientTest, PositionAddAtASequenceRank) {
  const Attrs rank1{{kSequenceRankAttr, int64_t{1}}};
  CheckGradients({.forward = "position_add_forward",
                  .forward_attrs = rank1,
                  .inputs = {RandomTensor({2, 3, 4}, 1), RandomTensor({7, 4}, 2)}});
  const Tensor x = RandomTensor({1, 3, 4}, 1), wpe = RandomTensor({7, 4}, 2);
  ASSERT_OK_AND_ASSIGN(auto shifted, RunKernel("position_add_forward", {x, wpe}, rank1));
  const std::vector<float> xs = ToVector(x), ws = ToVector(wpe), ys = ToVector(shifted[0]);
  for (size_t i = 0; i < ys.size(); ++i) EXPECT_EQ(ys[i], xs[i] + ws[i + 12]);
  Result<std::vector<Tensor>> past =
      RunKernel("position_add_forward", {x, wpe}, Attrs{{kSequenceRankAttr, int64_t{2}}});
  ASSERT_FALSE(past.ok());
  EXPECT_NE(past.status().message().find("at sequence rank 2"), std::string::npos)
      << past.status().ToString();
}

// The parts of T = 3 ranks sum to the whole ops': the embedding parts to embedding_forward's
// token rows, and the cross-entropy from the summed statistics to softmax_cross_entropy's loss
// and gradient over the whole vocabulary.
TEST(OpGradientTest, VocabParallelPartsSumToTheWholeOps) {
  constexpr int64_t kRanks = 3, kShard = 11, kVocab = kRanks * kShard, kRows = 24, kC = 8;
  const Tensor tokens = RandomTokens({4, 6}, kVocab, 1);
  const Tensor wte = RandomTensor({kVocab, kC}, 2);
  const Tensor logits = RandomTensor({kRows, kVocab}, 3, 4.0f);
  const Tensor targets = RandomTokens({kRows}, kVocab, 4);
  const std::vector<float> wte_values = ToVector(wte), logit_values = ToVector(logits);
  std::vector<float> embedded(static_cast<size_t>(int64_t{4} * 6 * kC), 0.0f);
  std::vector<float> stats(static_cast<size_t>(kRows * (kRanks + 1)), 0.0f);
  std::vector<Tensor> shard_logits;
  for (int64_t t = 0; t < kRanks; ++t) {
    const Attrs attrs{{"ranks", kRanks}, {kTensorRankAttr, t}};
    const auto rows_of = [&](const std::vector<float>& whole, int64_t rows, int64_t width,
                             int64_t first, int64_t count, bool columns) {
      std::vector<float> part;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < count; ++j) {
          part.push_back(columns ? whole[static_cast<size_t>(i * width + first + j)]
                                 : whole[static_cast<size_t>((first + i) * width + j)]);
        }
      }
      return part;
    };
    const Tensor wte_shard =
        FloatTensor({kShard, kC}, rows_of(wte_values, kShard, kC, t * kShard, kC, false));
    ASSERT_OK_AND_ASSIGN(auto part,
                         RunKernel("vocab_shard_embedding_forward", {tokens, wte_shard}, attrs));
    const std::vector<float> part_values = ToVector(part[0]);
    for (size_t i = 0; i < embedded.size(); ++i) embedded[i] += part_values[i];
    shard_logits.push_back(FloatTensor(
        {kRows, kShard}, rows_of(logit_values, kRows, kVocab, t * kShard, kShard, true)));
    ASSERT_OK_AND_ASSIGN(auto shard_stats, RunKernel("vocab_shard_logit_stats",
                                                     {shard_logits.back(), targets}, attrs));
    const std::vector<float> stat_values = ToVector(shard_stats[0]);
    for (size_t i = 0; i < stats.size(); ++i) stats[i] += stat_values[i];
  }
  // embedding_forward adds wpe: with zero positions it is the token rows alone.
  ASSERT_OK_AND_ASSIGN(
      auto whole_embedding,
      RunKernel("embedding_forward",
                {tokens, wte, FloatTensor({6, kC}, std::vector<float>(6 * kC, 0))}));
  EXPECT_EQ(embedded, ToVector(whole_embedding[0]));
  const Tensor summed = FloatTensor({kRows, kRanks + 1}, stats);
  ASSERT_OK_AND_ASSIGN(auto loss, RunKernel("cross_entropy_from_stats", {summed}));
  ASSERT_OK_AND_ASSIGN(auto whole, RunKernel("softmax_cross_entropy", {logits, targets}));
  EXPECT_NEAR(ToVector(loss[0])[0], ToVector(whole[0])[0], 1e-6 * std::abs(ToVector(whole[0])[0]));
  // The gradient: dstats from the loss, then each rank's dlogits against the whole's columns.
  ASSERT_OK_AND_ASSIGN(
      auto dstats, RunKernel("cross_entropy_from_stats_backward", {ScalarTensor(1.0f), summed}));
  const std::vector<float> whole_grad = ToVector(whole[1]);
  for (int64_t t = 0; t < kRanks; ++t) {
    const Attrs attrs{{"ranks", kRanks}, {kTensorRankAttr, t}};
    ASSERT_OK_AND_ASSIGN(auto shard_stats,
                         RunKernel("vocab_shard_logit_stats",
                                   {shard_logits[static_cast<size_t>(t)], targets}, attrs));
    ASSERT_OK_AND_ASSIGN(
        auto dlogits,
        RunKernel("vocab_shard_logit_stats_backward",
                  {dstats[0], shard_logits[static_cast<size_t>(t)], targets, summed}, attrs));
    const std::vector<float> grad = ToVector(dlogits[0]);
    std::vector<float> expected;
    for (int64_t i = 0; i < kRows; ++i) {
      for (int64_t j = 0; j < kShard; ++j) {
        expected.push_back(whole_grad[static_cast<size_t>(i * kVocab + t * kShard + j)]);
      }
    }
    EXPECT_LT(ScaledMaxError(grad, expected), 1e-5) << "rank " << t;
  }
}

Attrs Gpt2TestAttrs() {
  return Attrs{{"channels", int64_t{16}},
               {"heads", int64_t{2}},
               {"vocab", int64_t{11}},
               {"max_seq_len", int64_t{7}}};
}

TEST(OpGradientTest, TokenPositionEmbedding) {
  const Attrs attrs = Gpt2TestAttrs();
  CheckGradients({
      .forward = "token_position_embedding_forward",
      .backward = "token_position_embedding_backward",
      .forward_attrs = attrs,
      .backward_attrs = attrs,
      .inputs = {RandomTokens({2, 5}, 11, 1), RandomTensor({11 * 16 + 7 * 16}, 2)},
      .differentiable_outputs = {0},
      .checked = {{1, 0}},
      .backward_inputs = [](const Tensors& in, const Tensors&, const Tensors& g) -> Tensors {
        return {g[0], in[0], *Tensor::Zeros(in[1].meta(), TestAllocator())};
      },
  });
}

TEST(OpGradientTest, TransformerBlock) {
  const Attrs attrs = Gpt2TestAttrs();
  const int64_t c = 16, params = 12 * c * c + 13 * c;
  CheckGradients({
      .forward = "transformer_block_forward",
      .backward = "transformer_block_backward",
      .forward_attrs = attrs,
      .backward_attrs = attrs,
      .inputs = {RandomTensor({2, 5, c}, 1), RandomTensor({params}, 2, 0.5f)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}, {1, 1}},
      .backward_inputs = [](const Tensors& in, const Tensors& out, const Tensors& g) -> Tensors {
        return {g[0], in[0], out[1], in[1]};
      },
  });
}

// A block that saves less (attribute rebuild) computes the same output and, its backward
// recomputing the rest first, the same gradients, bit for bit: it runs the same kernels on the
// same inputs. What it saves shrinks from 15C floats a token to 9C (norms_gelu) and 7C
// (norms_gelu_attention), besides the per-row statistics it keeps or drops with them.
TEST(OpGradientTest, TransformerBlockRebuildsWhatItDidNotSaveBitForBit) {
  const int64_t b = 2, t = 5, c = 16, heads = 2, params = 12 * c * c + 13 * c;
  const Tensor x = RandomTensor({b, t, c}, 1), p = RandomTensor({params}, 2, 0.5f);
  const Tensor dy = RandomTensor({b, t, c}, 3);
  auto run = [&](const std::string& rebuild) {
    Attrs attrs = Gpt2TestAttrs();
    if (!rebuild.empty()) attrs.Set("rebuild", rebuild);
    Result<Tensors> forward = RunKernel("transformer_block_forward", {x, p}, attrs);
    TESSERA_CHECK(forward.ok(), "{}", forward.status().ToString());
    Result<Tensors> backward =
        RunKernel("transformer_block_backward", {dy, x, (*forward)[1], p}, attrs);
    TESSERA_CHECK(backward.ok(), "{}", backward.status().ToString());
    return Tensors{(*forward)[0], (*forward)[1], (*backward)[0], (*backward)[1]};
  };
  const Tensors whole = run("");
  const int64_t rows = b * t, stats = 2 * rows;
  EXPECT_EQ(whole[1].numel(), rows * 15 * c + 2 * stats + heads * t * b);
  const std::vector<std::pair<std::string, int64_t>> levels = {
      {"norms_gelu", rows * 9 * c + heads * t * b}, {"norms_gelu_attention", rows * 7 * c}};
  for (const auto& [rebuild, saved] : levels) {
    const Tensors lean = run(rebuild);
    EXPECT_EQ(lean[1].numel(), saved) << rebuild;
    for (size_t i : {size_t{0}, size_t{2}, size_t{3}}) {
      ASSERT_EQ(lean[i].numel(), whole[i].numel());
      EXPECT_EQ(std::memcmp(lean[i].raw_data(), whole[i].raw_data(),
                            static_cast<size_t>(whole[i].bytes())),
                0)
          << rebuild << ", output " << i;
    }
  }
  // Both ops check the attribute; the split halves rebuild nothing and say so.
  Attrs bad = Gpt2TestAttrs();
  bad.Set("rebuild", "everything");
  EXPECT_THAT(
      RunKernel("transformer_block_forward", {x, p}, bad).status().message(),
      ::testing::HasSubstr("use \"\" (save everything), norms_gelu or norms_gelu_attention"));
  Attrs lean = Gpt2TestAttrs();
  lean.Set("rebuild", "norms_gelu");
  const Tensor stash_saved = RandomTensor({rows * 9 * c + heads * t * b}, 4);
  EXPECT_THAT(
      RunKernel("transformer_block_backward_input", {dy, x, stash_saved, p}, lean)
          .status()
          .message(),
      ::testing::HasSubstr("the split block backward (zero-bubble schedules) rebuilds nothing"));
}

// The head's forward produces the loss (a scalar) and keeps dlogits; its backward returns the
// gradients of that loss. L = loss.
TEST(OpGradientTest, TiedLmHead) {
  const Attrs attrs = Gpt2TestAttrs();
  CheckGradients({
      .forward = "tied_lm_head_forward",
      .backward = "tied_lm_head_backward",
      .forward_attrs = attrs,
      .backward_attrs = attrs,
      .inputs = {RandomTensor({2, 5, 16}, 1), RandomTensor({int64_t{2} * 16}, 2, 1.0f),
                 RandomTensor({11 * 16 + 7 * 16}, 3), RandomTokens({2, 5}, 11, 4)},
      .differentiable_outputs = {0},
      .checked = {{0, 0}, {1, 1}, {2, 2}},
      .backward_inputs = [](const Tensors& in, const Tensors& out, const Tensors& g) -> Tensors {
        // Upstream gradient of the loss must be 1 for the fused classifier; scale L instead.
        *g[0].data<float>() = 1.0f;
        return {in[0], out[1], in[1], in[2]};
      },
  });
}

// The fused classifier returns the loss and its gradient at once: check the gradient output
// against finite differences of the loss output.
TEST(OpGradientTest, SoftmaxCrossEntropy) {
  ExpectLossGradientMatchesFiniteDifferences(
      "softmax_cross_entropy", {RandomTensor({4, 9}, 1, 3.0f), RandomTokens({4}, 9, 2)},
      /*grad_scale=*/0.5);
}

TEST(OpGradientTest, SoftmaxCrossEntropyMatchesDirectFormula) {
  // logits [1, 3] = {1, 2, 3}, target 2: loss = log(e^1 + e^2 + e^3) - 3.
  ASSERT_OK_AND_ASSIGN(
      Tensors out,
      RunKernel("softmax_cross_entropy", {FloatTensor({1, 3}, {1, 2, 3}), IntTensor({1}, {2})}));
  const double expected = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)) - 3.0;
  EXPECT_NEAR(*out[0].data<float>(), expected, 1e-6);
}

// Ops whose correctness is checked by other tests (not differentiable, or compared with a
// naive reference instead): optimizer_test.cc.
// Collective members: against the reference in executor_test (one member) and
// collective_tasks_test (members on worker processes); compressed_all_reduce against a
// one-process reference of its arithmetic in compressed_allreduce_test (one member too) and on
// the collective engine in collective_engine_test.
const std::set<std::string> kCheckedElsewhere = {  // model_api_test: layers run through these
                                                   // ops match finite differences
    "layer_forward", "layer_backward", "loss_gradient", "reshape", "reshape_backward", "adamw",
    "onebit_adam", "onebit_adam_momentum", "onebit_adam_frozen", "zero_one_adam_compressed",
    "zero_one_adam_local", "zero_one_adam_sync", "scale", "sgd", "sum_of_squares", "clip_scale",
    "tied_lm_head_logits", "noop", "sleep", "all_reduce", "reduce_scatter", "all_gather",
    "broadcast", "all_gather_in_place", "all_to_all", "compressed_all_reduce", "sum_scalars",
    "accumulate", "copy", "constant", "write_file",
    // split_backward_test: the halves give the whole backward (checked here) bit for bit; the
    // linears' halves run inside the model-API GPT-2's split layers there.
    "transformer_block_backward_input", "transformer_block_backward_weight", "layer_backward_input",
    "layer_backward_weight", "linear_backward_input", "linear_backward_weight",
    "linear_no_bias_backward_weight"};

TEST(OpGradientTest, SleepReturnsItsInput) {
  Tensor x = RandomTensor({5}, 1);
  ASSERT_OK_AND_ASSIGN(Tensors out, RunKernel("sleep", {x}, Attrs{{"ms", int64_t{1}}}));
  EXPECT_EQ(ToVector(out[0]), ToVector(x));
  EXPECT_FALSE(RunKernel("sleep", {x}, Attrs{{"ms", int64_t{-1}}}).ok());
}

TEST(OpGradientTest, CopyReproducesItsInputBitForBit) {
  Tensor x = RandomTensor({3, 7}, 5);
  for (const char* op : {"copy", "identity"}) {
    ASSERT_OK_AND_ASSIGN(Tensors out, RunKernel(op, {x}));
    EXPECT_EQ(out[0].shape(), x.shape()) << op;
    EXPECT_EQ(ToVector(out[0]), ToVector(x)) << op;
    EXPECT_NE(out[0].raw_data(), x.raw_data()) << op;
  }
  // identity is its own gradient.
  CheckGradients({.forward = "identity", .inputs = {x}, .differentiable_outputs = {0}});
}

TEST(OpGradientTest, WriteFileWritesTheBytesAtomicallyAndReturnsAReceipt) {
  const std::filesystem::path dir = std::filesystem::path(TempPath("write_file_op"));
  std::filesystem::remove_all(dir);
  const std::string path = (dir / "rank1" / "h.0.params.bin").string();  // parents created
  Tensor x = RandomTensor({5, 3}, 9);
  ASSERT_OK_AND_ASSIGN(Tensors out, RunKernel("write_file", {x}, Attrs{{"path", path}}));
  ASSERT_EQ(out[0].dtype(), DType::kI64);
  EXPECT_EQ(out[0].data<int64_t>()[0], x.bytes());
  EXPECT_EQ(std::bit_cast<uint64_t>(out[0].data<int64_t>()[1]), Fnv1a(x.raw_data(), x.bytes()));
  std::ifstream in(path, std::ios::binary);
  std::vector<float> back(15);
  in.read(reinterpret_cast<char*>(back.data()), 15 * sizeof(float));
  EXPECT_EQ(in.gcount(), 15 * static_cast<std::streamsize>(sizeof(float)));
  EXPECT_EQ(back, ToVector(x));
  // No temporary file is left beside it.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir / "rank1"),
                          std::filesystem::directory_iterator()),
            1);
  // A path under a regular file cannot be created: an error naming it, not a crash.
  Result<Tensors> bad = RunKernel("write_file", {x}, Attrs{{"path", path + "/under/a/file"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(path), std::string::npos) << bad.status().message();
  std::filesystem::remove_all(dir);
}

TEST(OpGradientTest, ConstantIsItsValueAndNeedsOne) {
  ASSERT_OK_AND_ASSIGN(Tensors out, RunKernel("constant", {}, Attrs{{"value", 1.0}}));
  EXPECT_EQ(out[0].shape(), Shape{});
  EXPECT_EQ(*out[0].data<float>(), 1.0f);
  EXPECT_FALSE(RunKernel("constant", {}).ok()) << "a constant without its value";
}

TEST(OpGradientTest, NoopTakesNothingAndReturnsZero) {
  ASSERT_OK_AND_ASSIGN(Tensors out, RunKernel("noop", {}));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].shape(), Shape{});
  EXPECT_EQ(*out[0].data<float>(), 0.0f);
  ASSERT_OK_AND_ASSIGN(Tensors barrier, RunKernel("noop", {RandomTensor({3}, 1), out[0]}));
  EXPECT_EQ(*barrier[0].data<float>(), 0.0f);
  EXPECT_FALSE(RunKernel("clip_scale", {}).ok()) << "clip_scale needs an input";
}

// pack_shards lays out shard 0 of every input, then shard 1 of every input: a reduce-scatter of
// the packed buffer leaves member r shard r of each; split cuts it back into pieces.
TEST(OpGradientTest, PackShardsInterleavesShardsAndSplitCutsThemBack) {
  const Tensor a = FloatTensor({4}, {1, 2, 3, 4});
  const Tensor b = FloatTensor({6}, {10, 20, 30, 40, 50, 60});
  ASSERT_OK_AND_ASSIGN(Tensors packed,
                       RunKernel("pack_shards", {a, b}, Attrs{{"ranks", int64_t{2}}}));
  EXPECT_EQ(ToVector(packed[0]), (std::vector<float>{1, 2, 10, 20, 30, 3, 4, 40, 50, 60}));
  ASSERT_OK_AND_ASSIGN(Tensors concatenated,
                       RunKernel("pack_shards", {a, b}, Attrs{{"ranks", int64_t{1}}}));
  EXPECT_EQ(ToVector(concatenated[0]), (std::vector<float>{1, 2, 3, 4, 10, 20, 30, 40, 50, 60}));
  // Member 1's half of the packed buffer is shard 1 of a and of b.
  const Tensor half = FloatTensor({5}, {3, 4, 40, 50, 60});
  ASSERT_OK_AND_ASSIGN(Tensors pieces,
                       RunKernel("split", {half}, Attrs{{"sizes", std::vector<int64_t>{2, 3}}}));
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(ToVector(pieces[0]), (std::vector<float>{3, 4}));
  EXPECT_EQ(ToVector(pieces[1]), (std::vector<float>{40, 50, 60}));
  EXPECT_EQ(pieces[1].shape(), Shape{3});
  // What does not fit is refused, naming it.
  Result<Tensors> uneven = RunKernel("pack_shards", {a, b}, Attrs{{"ranks", int64_t{4}}});
  ASSERT_FALSE(uneven.ok());
  EXPECT_NE(uneven.status().message().find("not a multiple of the 4 shards"), std::string::npos)
      << uneven.status().message();
  Result<Tensors> short_sizes =
      RunKernel("split", {half}, Attrs{{"sizes", std::vector<int64_t>{2, 2}}});
  ASSERT_FALSE(short_sizes.ok());
  EXPECT_NE(short_sizes.status().message().find("adds up to 4"), std::string::npos)
      << short_sizes.status().message();
  // Sizes whose sum would overflow are refused, not wrapped.
  const int64_t huge = int64_t{1} << 62;
  EXPECT_FALSE(
      RunKernel("split", {half}, Attrs{{"sizes", std::vector<int64_t>{huge, huge, huge}}}).ok());
  EXPECT_FALSE(
      RunKernel("pack_shards", {a, IntTensor({2}, {1, 2})}, Attrs{{"ranks", int64_t{1}}}).ok())
      << "mixed dtypes";
}

TEST(OpGradientTest, EveryRegisteredOpIsChecked) {
  const std::set<std::string> checked_here = {"embedding_forward",
                                              "embedding_backward",
                                              "layernorm_forward",
                                              "layernorm_backward",
                                              "linear_forward",
                                              "linear_backward",
                                              "linear_no_bias_forward",
                                              "linear_no_bias_backward",
                                              "matmul_forward",
                                              "matmul_backward",
                                              "attention_forward",
                                              "attention_backward",
                                              "gelu_forward",
                                              "gelu_backward",
                                              "add_forward",
                                              "add_backward",
                                              "bias_add_forward",
                                              "bias_add_backward",
                                              "vocab_shard_embedding_forward",
                                              "vocab_shard_embedding_backward",
                                              "position_add_forward",
                                              "position_add_backward",
                                              "vocab_shard_logit_stats",
                                              "vocab_shard_logit_stats_backward",
                                              "cross_entropy_from_stats",
                                              "cross_entropy_from_stats_backward",
                                              "heads_to_chunks",
                                              "chunks_to_heads",
                                              "heads_linear_forward",
                                              "heads_linear_backward",
                                              "identity",
                                              "split_last_forward",
                                              "split_last_backward",
                                              "attention_block_forward",
                                              "attention_block_backward",
                                              "attention_merge_forward",
                                              "attention_merge_backward",
                                              "attention_block_accumulate_forward",
                                              "attention_block_accumulate_backward",
                                              "token_position_embedding_forward",
                                              "token_position_embedding_backward",
                                              "transformer_block_forward",
                                              "transformer_block_backward",
                                              "tied_lm_head_forward",
                                              "tied_lm_head_backward",
                                              "softmax_cross_entropy",
                                              "pack_shards",
                                              "split"};
  // The volume ops are checked in volume_ops_test.cc (which checks that each has a test).
  OpRegistry volume_ops;
  ASSERT_OK(RegisterVolumeOps(volume_ops));
  for (const std::string& op : CpuRegistry().OpNames()) {
    EXPECT_TRUE(checked_here.contains(op) || kCheckedElsewhere.contains(op) ||
                volume_ops.Find(op).ok())
        << "op '" << op << "' has no correctness test";
  }
}

}  // namespace
}  // namespace tessera::testing
